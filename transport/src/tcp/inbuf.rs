//! The buffer a served connection reads its frames through.

use std::os::fd::RawFd;

use crate::fdio::{self, iov, Conn, IoFail};
use crate::PollPolicy;

/// What a served connection reads at a time when it reads for itself: 8 KiB,
/// so that a one-descriptor WRITE of 4 KiB (header, table entry and payload)
/// comes in with one `recv`; a 4 KiB buffer took a second system call for
/// the last 48 bytes, about 1 µs of an 8 µs round trip on a 2-vCPU VM.
const IN_BUF_BYTES: usize = 8192;

/// Bytes read from a served connection and not parsed yet.
///
/// Headers, descriptor tables and notification payloads are read a buffer
/// at a time, so the frames that arrive together (a WRITE with a small
/// payload and the notification riding behind it) cost one `recv` instead
/// of one per piece. Payload bytes that came along are copied into their
/// registered ranges (under the block fence, like a `recv` into them);
/// the rest of a payload is read straight into registered memory.
pub(super) struct InBuf {
    bytes: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    pub(super) fn new() -> InBuf {
        InBuf {
            bytes: vec![0; IN_BUF_BYTES],
            start: 0,
            end: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.end - self.start
    }

    /// Room at the end for the next read, moving what is left to the front.
    pub(super) fn spare(&mut self) -> &mut [u8] {
        if self.start > 0 {
            self.bytes.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.bytes[self.end..]
    }

    /// One non-blocking read: `Ok(false)` when nothing was there.
    pub(super) fn try_fill(&mut self, fd: RawFd) -> Result<bool, IoFail> {
        let n = fdio::recv_now(fd, self.spare())?;
        self.end += n.unwrap_or(0);
        Ok(n.is_some())
    }

    /// Reads at least one byte, waiting for it.
    pub(super) async fn fill(&mut self, conn: &mut Conn, poll: PollPolicy) -> Result<(), IoFail> {
        let n = fdio::recv_some(&mut conn.rd, conn.fd, self.spare(), poll).await?;
        self.end += n;
        Ok(())
    }

    /// Drops up to `max` buffered bytes; returns how many.
    pub(super) fn skip(&mut self, max: u64) -> u64 {
        let n = (self.len() as u64).min(max);
        self.start += n as usize;
        n
    }

    /// Takes up to `dst.len()` buffered bytes into `dst`; returns how many.
    pub(super) fn drain(&mut self, dst: &mut [u8]) -> usize {
        let n = self.len().min(dst.len());
        dst[..n].copy_from_slice(&self.bytes[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// Takes up to `max` buffered bytes into the memory `iovs` name,
    /// advancing them past what was written; returns how many.
    pub(super) fn drain_into(&mut self, iovs: &mut [libc::iovec], max: u64) -> usize {
        let n = (self.len() as u64).min(max) as usize;
        fdio::copy_into(iovs, &self.bytes[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// Fills `dst` from the buffer, then from the socket.
    pub(super) async fn read_exact(
        &mut self,
        conn: &mut Conn,
        dst: &mut [u8],
        poll: PollPolicy,
    ) -> Result<(), IoFail> {
        let got = self.drain(dst);
        if got < dst.len() {
            let rest = &mut dst[got..];
            let mut v = [iov(rest.as_mut_ptr() as u64, rest.len() as u64)];
            fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, poll, None).await?;
        }
        Ok(())
    }
}
