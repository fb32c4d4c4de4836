//! TODO: filled by the planner work.
