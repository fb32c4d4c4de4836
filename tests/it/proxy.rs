//! An on-path attacker for tests: a TCP proxy that forwards connections
//! to a target, records what clients send, edits those bytes on demand
//! and cuts every connection it carries.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// What each connection sent, by accept order.
type Records = Arc<Mutex<Vec<Arc<Mutex<Vec<u8>>>>>>;

/// An edit the proxy makes to the bytes one connection (by accept order)
/// sends to the target.
pub(crate) enum Edit {
    /// Flips the bits of the byte at this offset.
    Flip { conn: usize, at: usize },
    /// Inserts bytes before the byte at this offset.
    Insert {
        conn: usize,
        at: usize,
        bytes: Vec<u8>,
    },
}

/// An on-path attacker: forwards every connection to the target, records
/// what initiators send, and makes the edits it is told to.
pub(crate) struct Proxy {
    pub(crate) addr: SocketAddr,
    edits: Arc<Mutex<VecDeque<Edit>>>,
    sent: Records,
    /// Both ends of every connection carried, to cut them.
    open: Arc<Mutex<Vec<(std::net::TcpStream, std::net::TcpStream)>>>,
}

impl Proxy {
    pub(crate) fn start(target: SocketAddr) -> Proxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let edits: Arc<Mutex<VecDeque<Edit>>> = Arc::default();
        let sent: Records = Arc::default();
        let open: Arc<Mutex<Vec<(std::net::TcpStream, std::net::TcpStream)>>> = Arc::default();
        let (e, s, o) = (edits.clone(), sent.clone(), open.clone());
        // Threads end with their sockets; the acceptor with the process.
        std::thread::spawn(move || {
            for (conn, client) in listener.incoming().enumerate() {
                let Ok(client) = client else { return };
                let upstream = std::net::TcpStream::connect(target).unwrap();
                let record: Arc<Mutex<Vec<u8>>> = Arc::default();
                s.lock().unwrap().push(record.clone());
                let (c2, u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
                let ends = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
                o.lock().unwrap().push(ends);
                let e = e.clone();
                std::thread::spawn(move || pump_up(conn, client, upstream, record, e));
                std::thread::spawn(move || pump_down(u2, c2));
            }
        });
        Proxy {
            addr,
            edits,
            sent,
            open,
        }
    }

    /// Cuts every connection carried so far, both ways (new ones are
    /// carried as before).
    pub(crate) fn cut(&self) {
        for (client, upstream) in self.open.lock().unwrap().drain(..) {
            let _ = client.shutdown(std::net::Shutdown::Both);
            let _ = upstream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Connections carried so far.
    pub(crate) fn connections(&self) -> usize {
        self.sent.lock().unwrap().len()
    }

    pub(crate) fn edit(&self, e: Edit) {
        self.edits.lock().unwrap().push_back(e);
    }

    /// What connection `conn` sent, bytes `range`.
    pub(crate) fn sent(&self, conn: usize, range: std::ops::Range<usize>) -> Vec<u8> {
        self.sent.lock().unwrap()[conn].lock().unwrap()[range].to_vec()
    }
}

fn pump_up(
    conn: usize,
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    record: Arc<Mutex<Vec<u8>>>,
    edits: Arc<Mutex<VecDeque<Edit>>>,
) {
    let mut buf = vec![0u8; 1 << 16];
    let mut offset = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        record.lock().unwrap().extend_from_slice(&buf[..n]);
        let mut chunk = buf[..n].to_vec();
        let mut insert = None;
        edits.lock().unwrap().retain(|e| match e {
            Edit::Flip { conn: c, at } if *c == conn && (offset..offset + n).contains(at) => {
                chunk[at - offset] ^= 0xFF;
                false
            }
            Edit::Insert { conn: c, at, bytes }
                if *c == conn && (offset..offset + n).contains(at) =>
            {
                insert = Some((at - offset, bytes.clone()));
                false
            }
            _ => true,
        });
        if let Some((i, bytes)) = insert {
            chunk.splice(i..i, bytes);
        }
        offset += n;
        if to.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

fn pump_down(mut from: std::net::TcpStream, mut to: std::net::TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
