//! TODO: filled by the recv work.
