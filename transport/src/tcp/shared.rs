//! What an endpoint lends both of its sides, the connections it serves
//! (`target`) and the sessions it opens (`session`): the cell holding its
//! block fence ([`FenceCell`]) and its device's copy streams and staging
//! pool ([`DeviceSide`]). The endpoint (`mod.rs`) builds them; they name
//! nothing of tcp but its settings (`config`), so neither side needs the
//! endpoint, or the other side, to reach them.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use super::config::StagingConfig;
use crate::device::{CopyTracker, Device, StagingPool};
use crate::fence::BlockFence;
use crate::TransportError;

pub(super) type FenceCell = Rc<RefCell<Option<Rc<BlockFence>>>>;

/// An endpoint's device: its copy streams and its staging pool, shared by
/// its served connections and its sessions.
pub(super) struct DeviceSide {
    pub(super) copies: Rc<CopyTracker>,
    pub(super) pool: Rc<StagingPool>,
}

impl DeviceSide {
    pub(super) fn new(
        device: Arc<dyn Device>,
        staging: &StagingConfig,
    ) -> Result<Rc<Self>, TransportError> {
        let during = "opening the device's copy streams";
        let copies = CopyTracker::new(Arc::clone(&device), staging.drain_max)
            .map_err(TransportError::device(during))?;
        Ok(Rc::new(DeviceSide {
            copies: Rc::new(copies),
            pool: StagingPool::new(
                device,
                staging.buffers,
                staging.buffer_bytes,
                staging.drain_max,
            ),
        }))
    }
}
