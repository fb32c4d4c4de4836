//! The properties the `tcp_header_decode` target checks on every input,
//! shared with the test that replays its seeds and corpus
//! (`tests/it/fuzz_seeds.rs`). Every property failure panics.

use kvferry::transport::internal::wire::{
    decode_entry, encode_entry, Header, RejectReason, ENTRY_LEN, HEADER_LEN, MAX_FRAME_DESCS,
};

/// `Header::decode` on the first 32 bytes, then the descriptor table the
/// way the target reads it (count bounded by `MAX_FRAME_DESCS`, table sized
/// from the count, every entry through `decode_entry`), and
/// `RejectReason`'s status byte mapping. The header format has no slack, so
/// a header that decodes must re-encode to the very same bytes. Returns the
/// header when one decodes.
pub(super) fn check_header(data: &[u8]) -> Option<Header> {
    let (hb, rest) = data.split_first_chunk::<HEADER_LEN>()?;
    let h = match Header::decode(hb) {
        Ok(h) => h,
        Err(reason) => {
            assert_eq!(reason, RejectReason::BadHeader);
            assert!(hb[0..4] != *b"KVF1" || hb[6] != 0 || hb[7] != 0);
            return None;
        }
    };
    assert_eq!(&h.encode(), hb, "header does not re-encode to its bytes");

    if h.status != 0 {
        let reason = RejectReason::from_status(h.status);
        assert_eq!(reason.to_status(), h.status);
        let _ = reason.to_string();
    }

    // As the target does: refuse counts outside 1..=MAX_FRAME_DESCS, size the
    // table from the count, then decode every entry (missing bytes read as
    // zero here; on a socket the read would block instead).
    if h.count == 0 || h.count > MAX_FRAME_DESCS {
        return Some(h);
    }
    let mut table = vec![0u8; h.count as usize * ENTRY_LEN];
    let n = rest.len().min(table.len());
    table[..n].copy_from_slice(&rest[..n]);
    let mut total: u64 = 0;
    let mut again = Vec::with_capacity(table.len());
    for i in 0..h.count as usize {
        let (addr, len) = decode_entry(&table, i);
        total = total.saturating_add(len);
        encode_entry(&mut again, addr, len);
    }
    assert_eq!(again, table, "descriptor table does not round-trip");
    std::hint::black_box(total);
    Some(h)
}
