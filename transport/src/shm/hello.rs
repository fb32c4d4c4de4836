//! The messages of the shm hello, and the socket calls that carry them.
//!
//! The hello runs in two steps. On the tcp connection the initiator sends
//! its host identity and a target that shares memory with it sends back an
//! [`Answer`]: its own identity, a one-time token and the name of its
//! abstract Unix socket. Over that socket the initiator presents the token
//! and the target sends an [`Offer`]: its lane, its fence geometry and the
//! regions it shares.
//!
//! The offer travels with file descriptors (`SCM_RIGHTS`): the control file
//! first, then one per shared region. Passing the open files rather than
//! names a peer would open means the peer maps exactly the sealed files the
//! target checked, and only a peer the target checked (same user by
//! `SO_PEERCRED`, holder of the token) gets them.
//!
//! Both ends of the exchange, `link` (the initiator) and `target`, import
//! from here; this module imports neither.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use super::ctl::MAX_SPACES;
use super::host::{HostId, HOST_ID_LEN};
use super::ShmRefusal;
use crate::device::IPC_HANDLE_LEN;
use crate::fence::slots::{FenceRegion, Space};
use crate::RegionInfo;

/// Bytes of the one-time token an answer hands out.
pub(crate) const TOKEN_LEN: usize = 16;
const OFFER_MAGIC: u64 = u64::from_le_bytes(*b"KVFSHMOF");
/// Most region files one offer passes (`SCM_MAX_FD` is 253, one is the
/// control file).
pub(crate) const MAX_OFFER_REGIONS: usize = 252;
/// Most fenced regions an offer lists.
const MAX_OFFER_FENCE: usize = 1 << 16;
/// Bytes of the socket's name in an answer (NUL-padded).
const NAME_LEN: usize = 64;
/// Bytes of the answer to a hello: the target's identity, a token and the
/// socket's name.
pub(crate) const ANSWER_LEN: usize = HOST_ID_LEN + TOKEN_LEN + NAME_LEN;
/// Most bytes of an offer a peer reads.
const MAX_OFFER_BYTES: u64 = 64 << 20;

/// `N` bytes from the operating system's random source. When it gives
/// none, the hello fails rather than use a guessable stand-in: a token or
/// socket name another process could predict would let it take the
/// target's files without having said hello.
fn random<const N: usize>() -> Result<[u8; N], ShmRefusal> {
    kvferry_auth::random().map_err(|_| ShmRefusal::NoRandomness)
}

/// A fresh one-time token for an answer.
pub(crate) fn fresh_token() -> Result<[u8; TOKEN_LEN], ShmRefusal> {
    random()
}

/// A fresh name for the abstract Unix socket of the target in process
/// `pid`; it fits an answer.
pub(crate) fn socket_name(pid: u32) -> Result<String, ShmRefusal> {
    let tag = u64::from_le_bytes(random()?);
    Ok(format!("kvferry-shm-{pid}-{tag:016x}"))
}

/// The kernel's record of who holds the other end of `conn`.
pub(crate) fn peer_cred(conn: &UnixStream) -> Result<libc::ucred, ShmRefusal> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` describe a buffer of the right size.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(ShmRefusal::io(io::Error::last_os_error()));
    }
    Ok(cred)
}

/// A target's answer to the shm hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) host: HostId,
    pub(crate) token: [u8; TOKEN_LEN],
    pub(crate) name: String,
}

impl Answer {
    /// The identity, the token, then the name NUL-padded to `NAME_LEN`.
    pub(crate) fn encode(&self) -> Result<[u8; ANSWER_LEN], ShmRefusal> {
        let name = self.name.as_bytes();
        if name.len() > NAME_LEN || name.contains(&0) {
            return Err(ShmRefusal::Malformed("socket name"));
        }
        let mut a = [0u8; ANSWER_LEN];
        a[..HOST_ID_LEN].copy_from_slice(&self.host.encode());
        a[HOST_ID_LEN..HOST_ID_LEN + TOKEN_LEN].copy_from_slice(&self.token);
        a[HOST_ID_LEN + TOKEN_LEN..][..name.len()].copy_from_slice(name);
        Ok(a)
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Answer, ShmRefusal> {
        if b.len() != ANSWER_LEN {
            return Err(ShmRefusal::Malformed("answer length"));
        }
        let host = HostId::decode(&b[..HOST_ID_LEN]).ok_or(ShmRefusal::Malformed("answer host"))?;
        let mut token = [0u8; TOKEN_LEN];
        token.copy_from_slice(&b[HOST_ID_LEN..HOST_ID_LEN + TOKEN_LEN]);
        let name = &b[HOST_ID_LEN + TOKEN_LEN..];
        let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
        let name = std::str::from_utf8(&name[..end])
            .map_err(|_| ShmRefusal::Malformed("socket name"))?
            .to_string();
        Ok(Answer { host, token, name })
    }
}

/// One shared region as an offer lists it (its file is passed beside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OfferRegion {
    pub(crate) info: RegionInfo,
    pub(crate) offset: u64,
}

/// One device region as an offer lists it: the range, its offset in its
/// allocation, and the allocation's IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OfferDevice {
    pub(crate) info: RegionInfo,
    pub(crate) offset: u64,
    pub(crate) handle: [u8; IPC_HANDLE_LEN],
}

/// What a target hands a peer: its map of shared memory and fence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub(crate) generation: u64,
    pub(crate) lane: usize,
    pub(crate) lanes: usize,
    pub(crate) counts: Vec<u64>,
    pub(crate) fence: Vec<FenceRegion>,
    pub(crate) regions: Vec<OfferRegion>,
    /// Device regions (the GPU hello); an offer without the list (an
    /// older target) has none.
    pub(crate) devices: Vec<OfferDevice>,
}

impl Offer {
    /// Little-endian words: length, magic, generation, lane, lanes, the
    /// counts, the fenced regions (base, stride, count, space), the shared
    /// regions (addr, len, offset), then the device regions (addr, len,
    /// offset, the handle's 64 bytes as 8 words).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = vec![0, OFFER_MAGIC, self.generation];
        w.extend([self.lane as u64, self.lanes as u64]);
        w.push(self.counts.len() as u64);
        w.extend(&self.counts);
        w.push(self.fence.len() as u64);
        for r in &self.fence {
            w.extend([r.base, r.stride, r.count, r.space.index() as u64]);
        }
        w.push(self.regions.len() as u64);
        for r in &self.regions {
            w.extend([r.info.addr, r.info.len_bytes, r.offset]);
        }
        w.push(self.devices.len() as u64);
        for d in &self.devices {
            w.extend([d.info.addr, d.info.len_bytes, d.offset]);
            w.extend(
                d.handle
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())),
            );
        }
        w[0] = (w.len() * 8) as u64;
        w.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Offer, ShmRefusal> {
        let bad = ShmRefusal::Malformed;
        let mut words = b
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()));
        let mut next = || words.next().ok_or(bad("short offer"));
        let len = next()?;
        if !b.len().is_multiple_of(8) || len != b.len() as u64 || next()? != OFFER_MAGIC {
            return Err(bad("offer header"));
        }
        let generation = next()?;
        let lane = next()? as usize;
        let lanes = next()? as usize;
        let n = next()? as usize;
        if n > MAX_SPACES {
            return Err(bad("spaces"));
        }
        let counts = (0..n).map(|_| next()).collect::<Result<Vec<_>, _>>()?;
        let fence = decode_fence(&mut next, counts.len())?;
        let regions = decode_regions(&mut next)?;
        let devices = decode_devices(&mut next)?;
        Ok(Offer {
            generation,
            lane,
            lanes,
            counts,
            fence,
            regions,
            devices,
        })
    }
}

/// The fenced regions of an offer, from its count on: each names one of
/// the `spaces` counted, and they come in order of base.
fn decode_fence(
    next: &mut impl FnMut() -> Result<u64, ShmRefusal>,
    spaces: usize,
) -> Result<Vec<FenceRegion>, ShmRefusal> {
    let bad = ShmRefusal::Malformed;
    let n = next()? as usize;
    if n > MAX_OFFER_FENCE {
        return Err(bad("fenced regions"));
    }
    let mut fence = Vec::with_capacity(n);
    for _ in 0..n {
        let (base, stride, count) = (next()?, next()?, next()?);
        let space = Space::from_index(next()?).ok_or(bad("space"))?;
        if space.index() >= spaces || stride == 0 || count == 0 {
            return Err(bad("fenced region"));
        }
        fence.push(FenceRegion {
            base,
            stride,
            count,
            space,
        });
    }
    if fence.windows(2).any(|w| w[0].base > w[1].base) {
        return Err(bad("fenced regions out of order"));
    }
    Ok(fence)
}

/// The shared regions of an offer, from their count on.
fn decode_regions(
    next: &mut impl FnMut() -> Result<u64, ShmRefusal>,
) -> Result<Vec<OfferRegion>, ShmRefusal> {
    let n = next()? as usize;
    if n > MAX_OFFER_REGIONS {
        return Err(ShmRefusal::Malformed("regions"));
    }
    let mut regions = Vec::with_capacity(n);
    for _ in 0..n {
        let (addr, len_bytes, offset) = (next()?, next()?, next()?);
        regions.push(OfferRegion {
            info: RegionInfo { addr, len_bytes },
            offset,
        });
    }
    Ok(regions)
}

/// The device regions of an offer, from their count on; an offer that
/// ends before the count (an older target's) has none.
fn decode_devices(
    next: &mut impl FnMut() -> Result<u64, ShmRefusal>,
) -> Result<Vec<OfferDevice>, ShmRefusal> {
    let n = next().unwrap_or(0) as usize;
    if n > MAX_OFFER_REGIONS {
        return Err(ShmRefusal::Malformed("device regions"));
    }
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        let (addr, len_bytes, offset) = (next()?, next()?, next()?);
        let mut handle = [0u8; IPC_HANDLE_LEN];
        for c in handle.chunks_exact_mut(8) {
            c.copy_from_slice(&next()?.to_le_bytes());
        }
        devices.push(OfferDevice {
            info: RegionInfo { addr, len_bytes },
            offset,
            handle,
        });
    }
    Ok(devices)
}

/// Sends `offer` with `fds` (the control file, then one per region).
pub(crate) fn send_offer(
    conn: &UnixStream,
    offer: &Offer,
    fds: &[RawFd],
) -> Result<(), ShmRefusal> {
    if fds.len() != offer.regions.len() + 1 || offer.regions.len() > MAX_OFFER_REGIONS {
        return Err(ShmRefusal::Malformed("too many regions to share"));
    }
    let bytes = offer.encode();
    let mut cbuf = vec![0u8; cmsg_space(fds.len())];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut _,
        iov_len: bytes.len(),
    };
    let msg = msghdr(&mut iov, &mut cbuf);
    // SAFETY: the control buffer has room for one header and the fds.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
    }
    // SAFETY: `msg` describes valid buffers.
    let n = unsafe { libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(ShmRefusal::io(io::Error::last_os_error()));
    }
    // The rest, if the socket took only part (the files came with the first byte).
    (&*conn)
        .write_all(&bytes[n as usize..])
        .map_err(ShmRefusal::io)
}

/// A message of one buffer and a control buffer; both must outlive its use.
fn msghdr(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: a zeroed msghdr is valid (no buffers).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    msg
}

fn cmsg_space(fds: usize) -> usize {
    // SAFETY: pure arithmetic.
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Receives an offer and its files.
pub(crate) fn recv_offer(conn: &UnixStream) -> Result<(Offer, Vec<OwnedFd>), ShmRefusal> {
    let mut buf = vec![0u8; 64 << 10];
    let mut cbuf = vec![0u8; cmsg_space(MAX_OFFER_REGIONS + 1)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut msg = msghdr(&mut iov, &mut cbuf);
    // SAFETY: `msg` describes valid buffers.
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n <= 0 {
        let e = if n == 0 {
            io::Error::from(io::ErrorKind::UnexpectedEof)
        } else {
            io::Error::last_os_error()
        };
        return Err(ShmRefusal::io(e));
    }
    let fds = take_fds(&msg);
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(ShmRefusal::Malformed("too many files"));
    }
    let mut got = n as usize;
    let want = if got >= 8 {
        u64::from_le_bytes(buf[..8].try_into().unwrap_or_default())
    } else {
        0
    };
    if !(8..=MAX_OFFER_BYTES).contains(&want) {
        return Err(ShmRefusal::Malformed("offer length"));
    }
    let want = want as usize;
    buf.resize(want.max(got), 0);
    while got < want {
        let k = io::Read::read(&mut &*conn, &mut buf[got..want]).map_err(ShmRefusal::io)?;
        if k == 0 {
            return Err(ShmRefusal::Malformed("short offer"));
        }
        got += k;
    }
    buf.truncate(got);
    Ok((Offer::decode(&buf)?, fds))
}

/// Takes ownership of the files in `msg`'s control messages.
fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, by its macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..n {
                    out.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    out
}

/// Decodes `bytes` as an offer, the way an initiator reads a target's,
/// and checks what decodes: within the bounds the decoder enforces, and
/// the same offer after encoding and decoding again. Panics where a
/// property fails; returns whether `bytes` decoded. The fuzz target
/// `shm_hello_decode` drives it.
#[doc(hidden)]
pub fn check_offer(bytes: &[u8]) -> bool {
    let Ok(o) = Offer::decode(bytes) else {
        return false;
    };
    assert!(o.counts.len() <= MAX_SPACES, "spaces");
    assert!(o.fence.len() <= MAX_OFFER_FENCE, "fenced regions");
    assert!(o.regions.len() <= MAX_OFFER_REGIONS, "regions");
    assert!(o.devices.len() <= MAX_OFFER_REGIONS, "device regions");
    let fenced = |r: &FenceRegion| r.space.index() < o.counts.len() && r.stride > 0 && r.count > 0;
    assert!(o.fence.iter().all(fenced), "a fenced region");
    assert!(o.fence.windows(2).all(|w| w[0].base <= w[1].base), "order");
    assert_eq!(Offer::decode(&o.encode()).as_ref(), Ok(&o), "re-encoded");
    true
}

/// Decodes `bytes` as an answer, the way an initiator reads a target's,
/// and checks what decodes: a name that fits, and the same answer after
/// encoding and decoding again. Panics where a property fails; returns
/// whether `bytes` decoded. The fuzz target `shm_hello_decode` drives it.
#[doc(hidden)]
pub fn check_answer(bytes: &[u8]) -> bool {
    let Ok(a) = Answer::decode(bytes) else {
        return false;
    };
    let again = a.encode().expect("a decoded answer encodes");
    assert_eq!(Answer::decode(&again).as_ref(), Ok(&a), "re-encoded");
    true
}

/// An offer of `regions` shared and device regions and `fenced` fenced
/// regions over two spaces.
fn sample_offer(regions: usize, fenced: usize) -> Offer {
    Offer {
        generation: 7,
        lane: 3,
        lanes: 64,
        counts: vec![1024, 16],
        fence: (0..fenced as u64)
            .map(|i| FenceRegion {
                base: 0x1000 + i * 0x10_0000,
                stride: 4096,
                count: 16,
                space: if i % 2 == 0 {
                    Space::Kv
                } else {
                    Space::Pool(0)
                },
            })
            .collect(),
        regions: (0..regions as u64)
            .map(|i| OfferRegion {
                info: RegionInfo {
                    addr: 0x7000_0000 + i * 0x100_0000,
                    len_bytes: 0x8000,
                },
                offset: i * 4096,
            })
            .collect(),
        devices: (0..regions as u64)
            .map(|i| OfferDevice {
                info: RegionInfo {
                    addr: 0x9000_0000 + i * 0x100_0000,
                    len_bytes: 0x4000,
                },
                offset: i * 512,
                handle: [i as u8 ^ 0x5a; IPC_HANDLE_LEN],
            })
            .collect(),
    }
}

/// An answer from process 4242 of user 1000.
fn sample_answer() -> Answer {
    Answer {
        host: HostId {
            boot_id: *b"0d4c6f2e-9a51-4b7e-8c3d-2f1e0a9b8c7d",
            netns: (4, 4026531840),
            uid: 1000,
            pid: 4242,
        },
        token: [0xa5; TOKEN_LEN],
        name: "kvferry-shm-4242-0123456789abcdef".into(),
    }
}

/// Valid encodings of each message, named: the fuzz target's seeds.
#[doc(hidden)]
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let answer = sample_answer()
        .encode()
        .map(|a| a.to_vec())
        .unwrap_or_default();
    vec![
        ("answer", answer),
        ("offer_empty", sample_offer(0, 0).encode()),
        ("offer_fenced", sample_offer(2, 3).encode()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn offer(regions: usize, fenced: usize) -> Offer {
        sample_offer(regions, fenced)
    }

    #[test]
    fn an_offer_round_trips_and_a_cut_or_bent_one_is_refused() {
        let o = offer(3, 4);
        let b = o.encode();
        assert_eq!(Offer::decode(&b), Ok(o));
        assert!(Offer::decode(&b[..b.len() - 8]).is_err(), "cut");
        let mut bent = b.clone();
        bent[8] ^= 1;
        assert!(Offer::decode(&bent).is_err(), "magic");
        let mut many = offer(0, 0);
        many.counts = vec![1; MAX_SPACES + 1];
        assert!(Offer::decode(&many.encode()).is_err(), "too many spaces");
        let mut space = offer(0, 1);
        space.fence[0].space = Space::Pool(5);
        assert!(
            Offer::decode(&space.encode()).is_err(),
            "a pool the counts lack"
        );
    }

    #[test]
    fn a_truncated_or_oversized_offer_is_refused_as_malformed() {
        let b = offer(2, 2).encode();
        for cut in [0, 7, 8, 15, b.len() - 1] {
            assert!(
                matches!(Offer::decode(&b[..cut]), Err(ShmRefusal::Malformed(_))),
                "cut at {cut}"
            );
        }
        let mut longer = b.clone();
        longer.extend([0; 8]);
        assert_eq!(
            Offer::decode(&longer),
            Err(ShmRefusal::Malformed("offer header")),
            "bytes past the length word"
        );
        let mut many = offer(0, 0);
        many.regions = vec![offer(1, 0).regions[0]; MAX_OFFER_REGIONS + 1];
        assert_eq!(
            Offer::decode(&many.encode()),
            Err(ShmRefusal::Malformed("regions"))
        );
        let mut many = offer(0, 0);
        many.devices = vec![offer(1, 0).devices[0]; MAX_OFFER_REGIONS + 1];
        assert_eq!(
            Offer::decode(&many.encode()),
            Err(ShmRefusal::Malformed("device regions"))
        );
    }

    #[test]
    fn an_offer_of_an_older_target_has_no_device_regions() {
        let o = offer(2, 1);
        let mut b = o.encode();
        // Up to the device count, which an older target never sent.
        let end = b.len() - 8 * (1 + o.devices.len() * (3 + IPC_HANDLE_LEN / 8));
        b.truncate(end);
        b[..8].copy_from_slice(&(end as u64).to_le_bytes());
        let older = Offer::decode(&b).unwrap();
        assert_eq!(older.devices, []);
        assert_eq!(older.regions, o.regions);
    }

    #[test]
    fn an_answer_round_trips_and_a_truncated_or_oversized_one_is_refused() {
        let a = sample_answer();
        let b = a.encode().unwrap();
        assert_eq!(Answer::decode(&b), Ok(a.clone()));
        let length = Err(ShmRefusal::Malformed("answer length"));
        assert_eq!(Answer::decode(&b[..ANSWER_LEN - 1]), length);
        assert_eq!(Answer::decode(&[]), length);
        let mut longer = b.to_vec();
        longer.push(0);
        assert_eq!(Answer::decode(&longer), length);
        let mut bent = b;
        bent[HOST_ID_LEN + TOKEN_LEN] = 0xff;
        assert_eq!(
            Answer::decode(&bent),
            Err(ShmRefusal::Malformed("socket name"))
        );
    }

    #[test]
    fn an_answer_with_a_name_that_does_not_fit_is_not_encoded() {
        let mut a = sample_answer();
        a.name = "x".repeat(NAME_LEN);
        assert_eq!(Answer::decode(&a.encode().unwrap()), Ok(a.clone()));
        a.name.push('x');
        assert_eq!(a.encode(), Err(ShmRefusal::Malformed("socket name")));
        a.name = "a\0b".into();
        assert_eq!(a.encode(), Err(ShmRefusal::Malformed("socket name")));
    }

    #[test]
    fn fresh_tokens_and_socket_names_differ_and_a_name_fits_an_answer() {
        assert_ne!(fresh_token().unwrap(), fresh_token().unwrap());
        let name = socket_name(u32::MAX).unwrap();
        assert!(name.len() <= NAME_LEN, "{name}");
        assert_ne!(name, socket_name(u32::MAX).unwrap());
    }

    #[test]
    fn every_seed_decodes_and_keeps_the_properties() {
        for (name, bytes) in seeds() {
            assert!(
                check_offer(&bytes) || check_answer(&bytes),
                "{name} does not decode"
            );
        }
    }

    proptest! {
        /// Whatever a peer sends, decoding returns, and what it accepts
        /// holds only what the bounds allow.
        #[test]
        fn decoding_any_bytes_returns_within_bounds(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(o) = Offer::decode(&bytes) {
                prop_assert!(o.regions.len() <= MAX_OFFER_REGIONS);
                prop_assert!(o.fence.len() <= MAX_OFFER_FENCE);
                prop_assert!(o.fence.iter().all(|r| r.space.index() < o.counts.len()));
            }
        }

        /// Decoding a valid offer with one word changed never panics.
        #[test]
        fn a_valid_offer_with_a_word_changed_decodes_or_is_refused(at in 0usize..64, word in any::<u64>()) {
            let mut b = offer(2, 2).encode();
            let i = (at % (b.len() / 8)) * 8;
            b[i..i + 8].copy_from_slice(&word.to_le_bytes());
            let _ = Offer::decode(&b);
        }

        /// Any bytes as an offer or an answer: the checks the fuzz target
        /// makes hold, and an answer decodes only at its exact length.
        #[test]
        fn any_bytes_keep_the_fuzz_targets_properties(bytes in proptest::collection::vec(any::<u8>(), 0..=2 * ANSWER_LEN)) {
            check_offer(&bytes);
            if check_answer(&bytes) {
                prop_assert_eq!(bytes.len(), ANSWER_LEN);
            }
        }

        /// A valid answer with one byte changed decodes or is refused as
        /// malformed, and keeps the properties.
        #[test]
        fn a_valid_answer_with_a_byte_changed_keeps_the_properties(at in 0..ANSWER_LEN, byte in any::<u8>()) {
            let mut b = sample_answer().encode().unwrap();
            b[at] = byte;
            match Answer::decode(&b) {
                Ok(_) => prop_assert!(check_answer(&b)),
                Err(e) => prop_assert!(matches!(e, ShmRefusal::Malformed(_))),
            }
        }
    }
}
