//! TODO: filled by the layout work.
