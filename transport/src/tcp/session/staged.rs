//! The initiator's side of device memory: a batch's descriptors whose
//! local side is device memory move through the endpoint's staging pool,
//! a piece of at most one buffer at a time, several pieces in flight, so
//! that one piece's device copy overlaps another's frames on the wire.

use futures::stream::{StreamExt, TryStreamExt};

use super::{blame_in, SessionInner};
use crate::device::Dir;
use crate::fence::Guard;
use crate::tcp::plan::plan;
use crate::tcp::shared::DeviceSide;
use crate::{Desc, MisuseError, Op, TransportError};

/// One piece: `desc` (at most one staging buffer long) of batch index `index`.
#[derive(Clone, Copy)]
struct Piece {
    index: usize,
    desc: Desc,
}

impl SessionInner {
    /// Moves a batch some of whose local side is device memory: the host
    /// descriptors as any batch, the device ones staged, both at once.
    /// Delivers no trailer (the caller sends it its own way).
    pub(super) async fn transfer_mixed(
        &self,
        op: Op,
        descs: &[Desc],
        bound: std::time::Duration,
    ) -> Result<bool, TransportError> {
        let on_device = self.local.device_flags(descs.iter().map(|d| d.local_addr));
        let (dev, host): (Vec<usize>, Vec<usize>) = (0..descs.len()).partition(|&i| on_device[i]);
        let host_descs: Vec<Desc> = host.iter().map(|&i| descs[i]).collect();
        let dev_descs: Vec<Desc> = dev.iter().map(|&i| descs[i]).collect();
        // The remote side of every descriptor is checked before any byte
        // moves, as for a host batch.
        self.check_remote_all(descs).await?;
        let host_part = async {
            if host_descs.is_empty() {
                return Ok(false);
            }
            let moved = Box::pin(self.transfer_host(op, &host_descs, None, bound)).await;
            moved.map_err(|e| blame_in(e, &host))
        };
        let dev_part = async {
            self.device_part(op, &dev_descs, bound)
                .await
                .map_err(|e| blame_in(e, &dev))
        };
        futures::future::try_join(host_part, dev_part).await?;
        Ok(false)
    }

    /// Moves descriptors whose local side is device memory: those into the
    /// peer's device memory opened here (same host, IPC) as copies on this
    /// endpoint's device, the rest staged.
    async fn device_part(
        &self,
        op: Op,
        descs: &[Desc],
        bound: std::time::Duration,
    ) -> Result<(), TransportError> {
        if descs.is_empty() {
            return Ok(());
        }
        match self.shm_first(op, descs, bound, true).await? {
            None => self.staged(op, descs).await,
            Some(rest) if rest.is_empty() => Ok(()),
            Some(rest) => {
                let part: Vec<Desc> = rest.iter().map(|&i| descs[i]).collect();
                self.staged(op, &part).await.map_err(|e| blame_in(e, &rest))
            }
        }
    }

    /// Checks every remote range against the peer's regions, fetching them
    /// again once if they look stale.
    async fn check_remote_all(&self, descs: &[Desc]) -> Result<(), TransportError> {
        if self.check_remote(descs).is_ok() {
            return Ok(());
        }
        let _turn = self.turns.acquire(1).await;
        let mut guards = self.free_streams(1)?;
        self.refresh_regions(&mut guards[0]).await?;
        self.check_remote(descs)
            .map_err(|(index, fault)| MisuseError::RemoteDescriptor { index, fault }.into())
    }

    /// Moves device descriptors through the staging pool, as many pieces
    /// in flight as half the pool holds (the other half serves the peers'
    /// frames into this endpoint's device memory).
    async fn staged(&self, op: Op, descs: &[Desc]) -> Result<(), TransportError> {
        let Some(dev) = &self.device else {
            unreachable!("device regions are registered only on an endpoint with a device")
        };
        let chunk = dev.pool.buffer_bytes() as u64;
        let pieces = descs.iter().enumerate().flat_map(|(index, d)| {
            (0..d.len_bytes.div_ceil(chunk)).map(move |k| {
                let off = k * chunk;
                Piece {
                    index,
                    desc: Desc {
                        local_addr: d.local_addr + off,
                        remote_addr: d.remote_addr + off,
                        len_bytes: chunk.min(d.len_bytes - off),
                    },
                }
            })
        });
        let depth = (self.config.staging.buffers / 2).max(1);
        futures::stream::iter(pieces)
            .map(|p| async move {
                let blame = [p.index];
                self.stage_piece(dev, op, p.desc)
                    .await
                    .map_err(|e| blame_in(e, &blame))
            })
            .buffer_unordered(depth)
            .try_for_each(|()| futures::future::ready(Ok(())))
            .await
    }

    /// One piece through one leased buffer: device to buffer, then the
    /// frames (a write); or the frames, then buffer to device (a read).
    /// The fence is asked right before the device copy is enqueued; a copy
    /// already enqueued is what a close waits for.
    async fn stage_piece(&self, dev: &DeviceSide, op: Op, d: Desc) -> Result<(), TransportError> {
        let mut lease = dev
            .pool
            .lease()
            .await
            .map_err(TransportError::device("leasing a staging buffer"))?;
        let wire = Desc {
            local_addr: lease.addr(),
            ..d
        };
        let during = "copying a staged piece";
        let fence = self.fence.borrow().clone();
        let guard = Guard::new(fence.as_deref());
        let range = [(d.local_addr, d.len_bytes)];
        // Held by the lease until the copy is done, even if this batch is
        // dropped first: the region cannot be unregistered under a copy.
        let pins = self
            .local
            .pin(range.iter().copied())
            .map_err(|(index, fault)| MisuseError::LocalDescriptor { index, fault })?;
        if op == Op::Read {
            self.run_plan(op, &[wire], &plan(&[wire], &self.config), None)
                .await?;
        }
        if !guard.check(range) {
            return Err(TransportError::Fenced { during });
        }
        let copy = match op {
            Op::Write => (Dir::ToHost, (wire.local_addr, d.local_addr, d.len_bytes)),
            Op::Read => (Dir::ToDevice, (d.local_addr, wire.local_addr, d.len_bytes)),
        };
        // SAFETY: the buffer is leased to this piece and the device range
        // pinned, both until the mark is done (`Lease::copying`).
        let mark = unsafe { dev.copies.copy(copy.0, &[copy.1]) }
            .map_err(TransportError::device(during))?;
        lease.copying(mark.clone(), Box::new(pins));
        mark.wait().await.map_err(TransportError::device(during))?;
        if op == Op::Write {
            self.run_plan(op, &[wire], &plan(&[wire], &self.config), None)
                .await?;
        }
        Ok(())
    }
}
