//! Planner spec parsing (filled by the planner work).
