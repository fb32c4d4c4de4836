//! The target side of the shared-memory path: the shareable regions, the
//! control file, and the Unix socket that hands them to peers.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, MutexGuard};

use kvferry_reactor::lock;

use super::ctl::{CtlOwner, DrainStats};
use super::hello::{self, Answer, Offer, OfferDevice, OfferRegion, ANSWER_LEN, TOKEN_LEN};
use super::host::HostId;
use super::mem::PeerMap;
use super::{ShmConfig, ShmRefusal, ShmStats};
use crate::fence::slots::FenceRegion;
use crate::fence::BlockFence;
use crate::RegionInfo;

/// Tokens handed out and not used yet: the oldest goes first.
const TOKENS_MAX: usize = 64;

struct SharedRegion {
    info: RegionInfo,
    fd: OwnedFd,
    offset: u64,
}

/// What the executor and the socket's thread share.
struct Shared {
    /// By registration id and piece (a registration may hold several
    /// shared pieces, or private edges around one).
    regions: BTreeMap<(u64, u32), SharedRegion>,
    ctl: Arc<CtlOwner>,
    fence: (Vec<FenceRegion>, Vec<u64>),
    /// The fence is too large for a control file: nothing is shared
    /// until a fence that fits is set.
    unfit: bool,
    tokens: VecDeque<[u8; TOKEN_LEN]>,
    links_served: u64,
    refused: u64,
    /// Drains of control files replaced since.
    retired: DrainStats,
    /// Device regions peers open by IPC handle, by registration id.
    devices: BTreeMap<u64, OfferDevice>,
}

/// An endpoint's shared-memory target.
pub(crate) struct ShmTarget {
    config: ShmConfig,
    host: HostId,
    /// The abstract Unix socket's name, as answers carry it.
    name: String,
    shared: Arc<Mutex<Shared>>,
    /// Closed on drop, which ends the socket's thread.
    _stop: OwnedFd,
}

impl ShmTarget {
    /// Binds the abstract Unix socket and starts its thread.
    pub(crate) fn start(config: &ShmConfig) -> io::Result<ShmTarget> {
        let mut host = HostId::current()?;
        if let Some(b) = config.boot_id_override {
            host.boot_id = b;
        }
        let ctl = CtlOwner::new(config.lanes, &[], config.drain_max)
            .ok_or_else(|| io::Error::other("shm control file"))?;
        // Without randomness there is no target: `TcpTransport::bind` logs
        // the error and serves tcp only.
        let name = hello::socket_name(host.pid).map_err(io::Error::other)?;
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name)?)?;
        let shared = Arc::new(Mutex::new(Shared {
            regions: BTreeMap::new(),
            ctl: Arc::new(ctl),
            fence: (Vec::new(), Vec::new()),
            unfit: false,
            tokens: VecDeque::new(),
            links_served: 0,
            refused: 0,
            retired: DrainStats::default(),
            devices: BTreeMap::new(),
        }));
        let (stop_r, stop_w) = pipe()?;
        let s = Arc::clone(&shared);
        let timeout = config.handshake_timeout;
        std::thread::Builder::new()
            .name("kvferry-shm".into())
            .spawn(move || serve(listener, stop_r, s, timeout))?;
        Ok(ShmTarget {
            config: config.clone(),
            host,
            name,
            shared,
            _stop: stop_w,
        })
    }

    fn shared(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    /// The answer to a peer's hello, with a fresh token; `None` when the
    /// peer is elsewhere or there is nothing to share.
    pub(crate) fn hello(&self, peer: &HostId) -> Option<[u8; ANSWER_LEN]> {
        let mut sh = self.shared();
        if !self.host.shares_with(peer) {
            sh.refused += 1;
            return None;
        }
        if (sh.regions.is_empty() && sh.devices.is_empty()) || sh.unfit {
            return None;
        }
        // `None` answers the peer `Undeliverable`, which it takes as "shares
        // nothing" (`ShmRefusal::NotOffered`): it moves everything over tcp.
        let (token, bytes) = self
            .answer()
            .map_err(|e| tracing::warn!(error = %e, "shm: no answer to a hello; the peer uses tcp"))
            .ok()?;
        if sh.tokens.len() >= TOKENS_MAX {
            sh.tokens.pop_front();
        }
        sh.tokens.push_back(token);
        Some(bytes)
    }

    /// A fresh token and the answer that hands it out.
    fn answer(&self) -> Result<([u8; TOKEN_LEN], [u8; ANSWER_LEN]), ShmRefusal> {
        let token = hello::fresh_token()?;
        let answer = Answer {
            host: self.host,
            token,
            name: self.name.clone(),
        };
        Ok((token, answer.encode()?))
    }

    /// Shares piece `piece` of registration `id` (`info`, held by `fd`
    /// from `offset`) with peers from now on; peers holding an older map
    /// re-handshake.
    pub(crate) fn add_region(
        &self,
        (id, piece): (u64, u32),
        info: RegionInfo,
        fd: BorrowedFd<'_>,
        offset: u64,
    ) -> Result<(), ShmRefusal> {
        let fd = fd.try_clone_to_owned().map_err(ShmRefusal::io)?;
        // The same checks a peer makes, so a bad file fails here.
        drop(PeerMap::new(&fd, offset, info.len_bytes)?);
        let ctl = {
            let mut sh = self.shared();
            if sh.regions.len() >= hello::MAX_OFFER_REGIONS {
                return Err(ShmRefusal::Malformed("too many regions to share"));
            }
            if sh.unfit {
                return Err(ShmRefusal::Malformed("a block fence too large to share"));
            }
            sh.regions
                .insert((id, piece), SharedRegion { info, fd, offset });
            Arc::clone(&sh.ctl)
        };
        ctl.retire();
        Ok(())
    }

    /// Offers device region `info` of registration `id` to peers on this
    /// host, who open `export` (its allocation's IPC handle) and copy into
    /// or out of it under the same fence as shared host memory.
    pub(crate) fn add_device_region(
        &self,
        id: u64,
        info: RegionInfo,
        export: crate::device::IpcExport,
    ) -> Result<(), ShmRefusal> {
        let ctl = {
            let mut sh = self.shared();
            if sh.devices.len() >= hello::MAX_OFFER_REGIONS {
                return Err(ShmRefusal::Malformed("too many device regions to share"));
            }
            if sh.unfit {
                return Err(ShmRefusal::Malformed("a block fence too large to share"));
            }
            let region = OfferDevice {
                info,
                offset: export.offset,
                handle: export.handle,
            };
            sh.devices.insert(id, region);
            Arc::clone(&sh.ctl)
        };
        ctl.retire();
        Ok(())
    }

    /// Stops sharing registration `id`; returns once no peer copies into
    /// it.
    pub(crate) fn remove_region(&self, id: u64) {
        let ctl = {
            let mut sh = self.shared();
            let before = sh.regions.len() + sh.devices.len();
            sh.regions.retain(|&(i, _), _| i != id);
            sh.devices.remove(&id);
            (sh.regions.len() + sh.devices.len() != before).then(|| Arc::clone(&sh.ctl))
        };
        if let Some(ctl) = ctl {
            ctl.retire();
        }
    }

    /// Moves the shared fence from `old` to `new`: a new control file
    /// mirrors `new`, then the old one is retired (every peer's copy
    /// through it ended). Without a fence, shared memory is unfenced, as
    /// over tcp. A fence too large to share leaves peers on tcp.
    pub(crate) fn set_fence(&self, old: Option<&BlockFence>, new: Option<&BlockFence>) {
        let layout = new.map(BlockFence::layout).unwrap_or_default();
        let ctl = CtlOwner::new(self.config.lanes, &layout.1, self.config.drain_max);
        let Some(ctl) = ctl.map(Arc::new) else {
            tracing::warn!(
                slots = layout.1.iter().sum::<u64>(),
                "shm: the block fence is too large to share; peers use tcp"
            );
            {
                let mut sh = self.shared();
                sh.regions.clear();
                sh.devices.clear();
                sh.unfit = true;
            }
            self.retire_current(old);
            return;
        };
        if let Some(f) = new {
            f.attach(Arc::clone(&ctl));
        }
        let previous = {
            let mut sh = self.shared();
            sh.fence = layout;
            sh.unfit = false;
            std::mem::replace(&mut sh.ctl, ctl)
        };
        if let Some(f) = old {
            f.detach(&previous);
        }
        previous.retire();
        self.shared().retired.add(previous.stats());
    }

    fn retire_current(&self, old: Option<&BlockFence>) {
        let ctl = Arc::clone(&self.shared().ctl);
        if let Some(f) = old {
            f.detach(&ctl);
        }
        ctl.retire();
    }

    pub(crate) fn stats(&self) -> ShmStats {
        let sh = self.shared();
        let mut d = sh.ctl.stats();
        d.add(sh.retired);
        ShmStats {
            links_served: sh.links_served,
            refused: sh.refused,
            peers: sh.ctl.peers() as u64,
            drain_waits: d.waited,
            drain_peer_gone: d.peer_gone,
            drain_overruns: d.overruns,
        }
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both are new descriptors nobody else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Accepts peers one at a time until `stop`'s other end closes.
fn serve(
    listener: UnixListener,
    stop: OwnedFd,
    shared: Arc<Mutex<Shared>>,
    timeout: std::time::Duration,
) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        if n < 0 || fds[1].revents != 0 {
            return;
        }
        let Ok((conn, _)) = listener.accept() else {
            continue;
        };
        let _ = conn.set_read_timeout(Some(timeout));
        let _ = conn.set_write_timeout(Some(timeout));
        match hand_over(&conn, &shared) {
            Ok(()) => {}
            Err(e) => {
                lock(&shared).refused += 1;
                tracing::warn!(error = %e, "shm: refused a peer");
            }
        }
    }
}

/// Checks one peer and passes it the regions and the control file.
fn hand_over(conn: &UnixStream, shared: &Mutex<Shared>) -> Result<(), ShmRefusal> {
    let cred = hello::peer_cred(conn)?;
    // SAFETY: no preconditions.
    if cred.uid != unsafe { libc::geteuid() } {
        return Err(ShmRefusal::NotSameUser);
    }
    let mut token = [0u8; TOKEN_LEN];
    io::Read::read_exact(&mut &*conn, &mut token).map_err(ShmRefusal::io)?;
    let mut sh = lock(shared);
    let Some(pos) = sh.tokens.iter().position(|t| *t == token) else {
        return Err(ShmRefusal::Malformed("unknown token"));
    };
    sh.tokens.remove(pos);
    let held = conn
        .try_clone()
        .map_err(ShmRefusal::io)
        .map(OwnedFd::from)?;
    let lane = sh.ctl.take_lane(held).ok_or(ShmRefusal::NoLane)?;
    let offer = Offer {
        generation: sh.ctl.generation(),
        lane,
        lanes: sh.ctl.lanes(),
        counts: sh.fence.1.clone(),
        fence: sh.fence.0.clone(),
        regions: sh
            .regions
            .values()
            .map(|r| OfferRegion {
                info: r.info,
                offset: r.offset,
            })
            .collect(),
        devices: sh.devices.values().copied().collect(),
    };
    let mut fds = vec![sh.ctl.mem().fd().as_raw_fd()];
    fds.extend(sh.regions.values().map(|r| r.fd.as_raw_fd()));
    // Sent under the lock: the files stay open until the kernel took them,
    // and the count is right by the time the peer can ask for it.
    hello::send_offer(conn, &offer, &fds)?;
    sh.links_served += 1;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::mem::SharedMem;
    use crate::shm::ShmLink;
    use std::time::Duration;

    /// A target sharing one region, and a fresh answer to our own hello.
    fn target() -> (ShmTarget, SharedMem, Answer) {
        let t = ShmTarget::start(&ShmConfig::default()).unwrap();
        let mem = SharedMem::new("kvferry-test", 4096).unwrap();
        let info = RegionInfo {
            addr: mem.as_ptr() as u64,
            len_bytes: 4096,
        };
        t.add_region((1, 0), info, mem.fd(), 0).unwrap();
        let me = HostId::current().unwrap();
        let answer = Answer::decode(&t.hello(&me).unwrap()).unwrap();
        (t, mem, answer)
    }

    #[test]
    fn a_peer_of_another_user_is_refused_by_its_socket_credentials() {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            panic!("this test switches a child to another user: run it as root");
        }
        let (t, _mem, answer) = target();
        let name = answer.name.clone().into_bytes();
        let token = answer.token;
        // The child only makes system calls: safe after fork.
        // SAFETY: see above; the child ends with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: plain system calls on local buffers.
            unsafe {
                if libc::setuid(65534) != 0 {
                    libc::_exit(3);
                }
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let mut addr: libc::sockaddr_un = std::mem::zeroed();
                addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
                for (i, &c) in name.iter().enumerate() {
                    addr.sun_path[i + 1] = c as libc::c_char;
                }
                let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as u32;
                if libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) != 0 {
                    libc::_exit(4);
                }
                libc::write(fd, token.as_ptr().cast(), token.len());
                let mut b = [0u8; 64];
                // An offer would come back; a refusal closes the socket
                // (with our token unread: a reset).
                let n = libc::read(fd, b.as_mut_ptr().cast(), b.len());
                libc::_exit(if n > 0 { 1 } else { 0 });
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "the other user got no offer");
        let st = t.stats();
        assert_eq!((st.refused, st.links_served), (1, 0));
        // The same token, from this user: the control case gets the offer
        // (the refusal did not use up the token).
        let me = HostId::current().unwrap();
        let link = ShmLink::establish(&answer, &me, Duration::from_secs(2), None).unwrap();
        drop(link);
        assert_eq!(t.stats().links_served, 1);
    }

    #[test]
    fn a_token_is_good_once() {
        let (t, _mem, answer) = target();
        let me = HostId::current().unwrap();
        assert!(ShmLink::establish(&answer, &me, Duration::from_secs(2), None).is_ok());
        let again = ShmLink::establish(&answer, &me, Duration::from_secs(2), None);
        assert!(again.is_err(), "a replayed token");
        let st = t.stats();
        assert_eq!((st.links_served, st.refused), (1, 1));
    }
}
