//! Data plane (filled by the transport work).
