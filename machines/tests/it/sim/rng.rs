//! A small deterministic PRNG (SplitMix64): the whole run is a function of the seed.

/// SplitMix64. Not for cryptography; fast, tiny and with good enough
/// statistics to drive fault injection.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6A09_E667_F3BC_C909)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        debug_assert!(lo <= hi);
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `ppm` parts per million.
    pub(crate) fn chance(&mut self, ppm: u32) -> bool {
        self.below(1_000_000) < ppm as u64
    }

    /// An independent stream, so that adding draws to one part of the
    /// simulation does not shift every later draw of another part.
    pub(crate) fn fork(&mut self) -> Rng {
        Rng(self.next_u64())
    }
}
