//! `kvferry bench transport --baseline pingpong`: what one small batch costs
//! at best over loopback TCP, measured in the same run as kvferry.
//!
//! Two threads, placed like the bench's executors (the client on core 0 like
//! the initiator, the server on core 1 like the target, when the bench
//! pins), exchange the bytes of one kvferry batch over one blocking
//! `TCP_NODELAY` connection: the request is a 32-byte header and a
//! descriptor table of 16 bytes a descriptor (and a WRITE's payload), the
//! answer a 32-byte header (and a READ's payload), as on kvferry's wire.
//! Neither side ever sleeps: each busy-polls with non-blocking `recv` calls
//! until its whole message is in, so the round trip is the kernel's loopback
//! cost and nothing else. No framing, checks or memory registration.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use kvferry::transport::Op;

/// Bytes of a kvferry frame header and of one descriptor table entry.
const HEADER: u64 = 32;
const ENTRY: u64 = 16;

/// One ping-pong measurement.
#[derive(Debug)]
pub(crate) struct PingPong {
    pub(crate) round_trips: u64,
    pub(crate) latencies: kvferry::Latency,
}

/// What one round trip carries, each way.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) block_bytes: u64,
    pub(crate) batch: u64,
    pub(crate) op: Op,
}

impl Shape {
    /// Bytes of the request and of the answer.
    fn sizes(&self) -> (usize, usize) {
        let payload = self.block_bytes * self.batch;
        let (req, resp) = match self.op {
            Op::Write => (HEADER + ENTRY * self.batch + payload, HEADER),
            Op::Read => (HEADER + ENTRY * self.batch, HEADER + payload),
        };
        (req as usize, resp as usize)
    }
}

/// Runs round trips of `shape` back to back for `seconds` (after 200 ms of
/// warm-up), the client on `cores.0` and the server on `cores.1` when given.
pub(crate) fn measure(
    shape: Shape,
    seconds: f64,
    cores: Option<(usize, usize)>,
) -> io::Result<PingPong> {
    let (req, resp) = shape.sizes();
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::Builder::new()
        .name("bench-pingpong-server".into())
        .spawn(move || -> io::Result<()> {
            if let Some((_, core)) = cores {
                pin_to(core);
            }
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            let (mut inb, out) = (vec![0u8; req], vec![0x5Au8; resp]);
            // Serves until the client closes.
            while spin_read(&s, &mut inb)? {
                s.write_all(&out)?;
            }
            Ok(())
        })?;
    let client = std::thread::Builder::new()
        .name("bench-pingpong-client".into())
        .spawn(move || run_client(addr, (req, resp), seconds, cores.map(|c| c.0)))?
        .join()
        .map_err(|_| io::Error::other("the ping-pong client panicked"))?;
    if client.is_err() {
        // The server may still wait for its connection: give it one that
        // closes at once.
        let _ = TcpStream::connect(addr);
    }
    // The client's socket is closed by now, which ends the server.
    let served = server
        .join()
        .map_err(|_| io::Error::other("the ping-pong server panicked"))?;
    let m = client?;
    served?;
    Ok(m)
}

/// The client side of [`measure`]: `sizes` are the request's and the
/// answer's bytes.
fn run_client(
    addr: SocketAddr,
    sizes: (usize, usize),
    seconds: f64,
    core: Option<usize>,
) -> io::Result<PingPong> {
    if let Some(core) = core {
        pin_to(core);
    }
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let (out, mut inb) = (vec![0xA5u8; sizes.0], vec![0u8; sizes.1]);
    let mut round_trip = || -> io::Result<Duration> {
        let t0 = Instant::now();
        c.write_all(&out)?;
        if !spin_read(&c, &mut inb)? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(t0.elapsed())
    };
    let warm_until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < warm_until {
        round_trip()?;
    }
    let mut m = PingPong {
        round_trips: 0,
        latencies: kvferry::Latency::new(),
    };
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < until {
        m.latencies.record(round_trip()?);
        m.round_trips += 1;
    }
    Ok(m)
}

/// Fills `buf` from the blocking socket `s` without ever sleeping in the
/// kernel: non-blocking `recv` calls until it is full. `Ok(false)` when the
/// peer closed before the first byte.
fn spin_read(s: &TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: `rest` is a writable buffer of that length and the
        // descriptor is `s`'s open socket.
        let r = unsafe {
            libc::recv(
                s.as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match r {
            0 if got == 0 => return Ok(false),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => got += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) {
                    return Err(e);
                }
                std::hint::spin_loop();
            }
        }
    }
    Ok(true)
}

/// Pins the calling thread to `core` (best effort, like glommio's
/// `Placement::Fixed`).
fn pin_to(core: usize) {
    // SAFETY: cpu_set_t is plain data, filled by the libc macros; the call
    // only affects the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_have_the_size_of_a_kvferry_batch() {
        let write = Shape {
            block_bytes: 4096,
            batch: 1,
            op: Op::Write,
        };
        assert_eq!(write.sizes(), (32 + 16 + 4096, 32));
        let read = Shape {
            op: Op::Read,
            batch: 2,
            ..write
        };
        assert_eq!(read.sizes(), (32 + 32, 32 + 8192));
    }

    #[test]
    fn a_short_ping_pong_completes_round_trips() {
        let shape = Shape {
            block_bytes: 64,
            batch: 1,
            op: Op::Write,
        };
        let m = measure(shape, 0.05, None).unwrap();
        assert!(m.round_trips > 0);
        assert_eq!(m.latencies.count(), m.round_trips);
    }
}
