//! How the demo-style runs print what they measured: durations in
//! milliseconds, a progress bar.

use std::time::Duration;

/// Milliseconds, as the reports print them.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A 40-character progress bar, `[####    ]`, `done` of `of` filled.
pub(crate) fn bar(done: u64, of: u64) -> String {
    const WIDTH: u64 = 40;
    let filled = (done.min(of) * WIDTH / of.max(1)) as usize;
    format!(
        "[{}{}]",
        "#".repeat(filled),
        " ".repeat(WIDTH as usize - filled)
    )
}
