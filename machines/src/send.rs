//! TODO: filled by the send work.
