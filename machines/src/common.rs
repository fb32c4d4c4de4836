//! Types shared by the send and receive machines, one module per concept,
//! all re-exported here and at the crate root.

mod config;
mod deadline;
mod drain;
mod late;
mod lease;
mod lists;
mod msg;
mod outcome;
mod resend;
mod transfer;

pub use config::Config;
pub use late::{blocks_fingerprint, late_answer};
pub use lease::TICKET_BIT;
pub use msg::Msg;
pub use outcome::{AbortReason, FailReason, InputError, Phase};
pub use transfer::{
    check_request_id, BlockId, BlockLists, Mode, PeerId, RequestIdError, TransferId,
    REQUEST_ID_MAX_BYTES,
};

pub(crate) use deadline::{after, earliest};
pub(crate) use drain::{Drain, End, Next, Posted};
pub(crate) use lease::{GrantLease, TouchLease};
pub(crate) use lists::{align_chunk, check_lists, chunk_end, covers_exactly, is_empty_lists};
pub(crate) use resend::Resend;
