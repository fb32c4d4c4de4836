//! `kvferry bench transport --transport shm|auto`: the initiator here, the
//! target in a peer process of its own (`kvferry bench transport-peer`,
//! hidden), so the bytes cross two address spaces as between two engines
//! on one host.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use clap::Args;
use glommio::LocalExecutorBuilder;
use kvferry::transport::{
    EndpointAddr, Op, Session, SharedMem, ShmConfig, ShmMode, TcpConfig, TcpTransport, Transport,
};

use super::measure::{self, Measured, Params};

/// The options of the hidden `kvferry bench transport-peer`.
#[derive(Clone, Debug, Args)]
pub(crate) struct PeerArgs {
    /// Bytes of shared memory to serve.
    #[arg(long)]
    bytes: u64,
    /// Fill them with the bench's pattern (a read bench) instead of zeros.
    #[arg(long)]
    pattern: bool,
}

/// The peer: serves `bytes` of shared memory, prints `ENDPOINT`, then
/// answers each `digest` line on stdin with its memory's digest; ends at
/// end of input.
pub(crate) fn peer_main(a: &PeerArgs) -> std::process::ExitCode {
    let run = move || -> Result<(), String> {
        let mem = SharedMem::new("kvferry-bench", a.bytes as usize).map_err(|e| e.to_string())?;
        if a.pattern {
            // SAFETY: the fresh mapping, not registered yet.
            let s = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr(), mem.len()) };
            measure::fill_pattern(s);
        }
        let (mem_addr, mem_len) = (mem.as_ptr() as u64, mem.len());
        LocalExecutorBuilder::default()
            .name("bench-peer")
            .spawn(move || async move {
                let config = TcpConfig {
                    shm: shm(ShmMode::Require),
                    ..TcpConfig::default()
                };
                let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config)
                    .map_err(|e| e.to_string())?;
                // SAFETY: `mem` outlives the endpoint (this thread is
                // joined before it drops); only peers touch it meanwhile.
                unsafe { t.register(mem_addr as usize as *mut u8, mem_len) }
                    .map_err(|e| e.to_string())?;
                println!("{} {mem_addr}", t.endpoint_addr());
                let lines = blocking_lines();
                while let Ok(line) = lines.recv_async().await {
                    if line.trim() == "digest" {
                        // SAFETY: the initiator is idle while it asks.
                        let s = unsafe {
                            std::slice::from_raw_parts(mem_addr as usize as *const u8, mem_len)
                        };
                        println!("{}", digest(s));
                    }
                }
                drop(t);
                Ok::<(), String>(())
            })
            .map_err(|e| e.to_string())?
            .join()
            .map_err(|e| e.to_string())??;
        drop(mem);
        Ok(())
    };
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvferry bench transport-peer: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Stdin's lines, read on a thread of their own.
pub(crate) fn blocking_lines() -> flume::Receiver<String> {
    let (tx, rx) = flume::bounded(1);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// FNV-1a over the bytes: equal memory, equal digest.
pub(crate) fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn shm(mode: ShmMode) -> ShmConfig {
    ShmConfig {
        mode,
        ..ShmConfig::default()
    }
}

/// A peer process of a bench (this binary, a hidden subcommand), talked
/// to by lines on its stdin and stdout; killed on drop.
pub(crate) struct PeerProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl PeerProcess {
    /// Starts `kvferry ARGS` and returns it with the first line it prints.
    pub(crate) fn spawn(args: &[String]) -> Result<(PeerProcess, String), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the peer process: {e}"))?;
        let stdin = child.stdin.take().ok_or("peer stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("peer stdout")?);
        let mut peer = PeerProcess {
            child,
            stdin,
            stdout,
        };
        let first = peer.line()?;
        Ok((peer, first))
    }

    fn line(&mut self) -> Result<String, String> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(n) if n > 0 => Ok(line),
            _ => Err("the peer process ended".into()),
        }
    }

    /// Sends `question` and parses the line that answers it as a number.
    pub(crate) fn ask(&mut self, question: &str) -> Result<u64, String> {
        writeln!(self.stdin, "{question}").map_err(|e| e.to_string())?;
        self.line()?
            .trim()
            .parse()
            .map_err(|_| format!("a bad answer to {question:?}"))
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The peer of `bench transport`: its endpoint and its memory's address.
struct Peer {
    process: PeerProcess,
}

impl Peer {
    fn start(bytes: u64, pattern: bool) -> Result<(Peer, EndpointAddr, u64), String> {
        let mut args: Vec<String> = ["bench", "transport-peer", "--bytes"]
            .map(String::from)
            .into();
        args.push(bytes.to_string());
        if pattern {
            args.push("--pattern".into());
        }
        let (process, line) = PeerProcess::spawn(&args)?;
        let mut it = line.split_whitespace();
        let addr = it.next().and_then(|a| a.parse().ok());
        let base = it.next().and_then(|b| b.parse().ok());
        match (addr, base) {
            (Some(addr), Some(base)) => Ok((Peer { process }, addr, base)),
            _ => Err(format!("the peer said {line:?}")),
        }
    }

    fn digest(&mut self) -> Result<u64, String> {
        self.process.ask("digest")
    }
}

/// One measurement: this process initiates batches into (or out of) the
/// peer's shared memory through the shm path (`mode` Require) or whatever
/// `auto` picks.
pub(crate) fn run(p: &Params, mode: ShmMode) -> Result<Measured, String> {
    let total = measure::buffer_bytes(p);
    let (mut peer, addr, base) = Peer::start(total, p.op == Op::Read)?;
    // The local side of the batches, as in the in-process benches: the
    // source of writes, the destination of reads (zeros until then).
    let mut src = vec![0u8; total as usize];
    if p.op == Op::Write {
        measure::fill_pattern(&mut src);
    }
    let local = src.as_mut_ptr() as u64;
    let p2 = p.clone();
    let m = LocalExecutorBuilder::new(measure::placement(p.pin, 0))
        .name("bench-initiator")
        .spawn(move || async move {
            let config = TcpConfig {
                poll: p2.poll,
                streams: p2.streams,
                shm: shm(mode),
                ..TcpConfig::default()
            };
            let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config)
                .map_err(|e| e.to_string())?;
            // SAFETY: the buffer outlives this thread, which is joined
            // before it is touched again.
            unsafe { t.register(local as usize as *mut u8, total as usize) }
                .map_err(|e| e.to_string())?;
            let session = t.open(&addr).await.map_err(|e| e.to_string())?;
            let through_shm = session.uses_shm();
            let batch = measure::descs(&p2, local, base);
            let m = measure::drive(&p2, &session, &batch).await;
            session.close().await;
            m.map(|m| (m, through_shm))
        })
        .map_err(|e| format!("starting the initiator executor: {e}"))?
        .join()
        .map_err(|e| format!("initiator executor: {e}"))??;
    let (mut m, through_shm) = m;
    if mode == ShmMode::Require && !through_shm {
        return Err("the batches did not go through shared memory".into());
    }
    // Both ends hold the pattern now: the peer's memory after writes, ours
    // after reads.
    m.verified = match p.op {
        Op::Write => peer.digest()? == digest(&src),
        Op::Read => src == src_pattern(total),
    };
    // memcpy from the buffer that holds the data, into a fresh one.
    let mut dst = src_pattern(total);
    m.memcpy_gbps =
        measure::measure_memcpy(&src, &mut dst, p.block_bytes as usize, p.seconds.min(1.0));
    Ok(m)
}

fn src_pattern(total: u64) -> Vec<u8> {
    let mut v = vec![0u8; total as usize];
    measure::fill_pattern(&mut v);
    v
}
