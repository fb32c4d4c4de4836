//! How a batch is cut into frames.

use std::borrow::Cow;

use super::config::TcpConfig;
use crate::Desc;

/// One frame of a batch: descriptors `start..end` of the (split) batch.
#[derive(Clone, Copy, Debug)]
pub(super) struct FrameSpec {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) bytes: u64,
}

/// A batch cut to frame size.
pub(super) struct Plan<'a> {
    pub(super) descs: Cow<'a, [Desc]>,
    /// Index in the caller's batch of each descriptor, when some were split.
    pub(super) origin: Option<Vec<usize>>,
    pub(super) frames: Vec<FrameSpec>,
}

pub(super) fn plan<'a>(descs: &'a [Desc], config: &TcpConfig) -> Plan<'a> {
    let max_bytes = config.frame_max_bytes;
    let (descs, origin) = if descs.iter().any(|d| d.len_bytes > max_bytes) {
        let mut split = Vec::with_capacity(descs.len());
        let mut origin = Vec::with_capacity(descs.len());
        for (i, d) in descs.iter().enumerate() {
            let mut off = 0;
            while off < d.len_bytes {
                let len = (d.len_bytes - off).min(max_bytes);
                // The remote side is only checked after planning, so a
                // hostile `remote_addr` must not overflow here; wrapped
                // pieces fail that check like the original would.
                split.push(Desc {
                    local_addr: d.local_addr.wrapping_add(off),
                    remote_addr: d.remote_addr.wrapping_add(off),
                    len_bytes: len,
                });
                origin.push(i);
                off += len;
            }
        }
        (Cow::Owned(split), Some(origin))
    } else {
        (Cow::Borrowed(descs), None)
    };
    let mut frames = Vec::new();
    let mut cur = FrameSpec {
        start: 0,
        end: 0,
        bytes: 0,
    };
    for (i, d) in descs.iter().enumerate() {
        let full = cur.end - cur.start >= config.frame_max_descs as usize
            || cur.bytes + d.len_bytes > max_bytes;
        if cur.end > cur.start && full {
            frames.push(cur);
            cur = FrameSpec {
                start: i,
                end: i,
                bytes: 0,
            };
        }
        cur.end = i + 1;
        cur.bytes += d.len_bytes;
    }
    if cur.end > cur.start {
        frames.push(cur);
    }
    Plan {
        descs,
        origin,
        frames,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_splits_and_groups() {
        let config = TcpConfig {
            frame_max_bytes: 100,
            frame_max_descs: 3,
            ..TcpConfig::default()
        };
        let d = |len| Desc {
            local_addr: 0,
            remote_addr: 1000,
            len_bytes: len,
        };
        let descs = [d(250), d(10), d(10), d(10), d(10), d(90)];
        let p = plan(&descs, &config);
        let sizes: Vec<u64> = p.descs.iter().map(|d| d.len_bytes).collect();
        assert_eq!(sizes, vec![100, 100, 50, 10, 10, 10, 10, 90]);
        assert_eq!(p.origin.as_deref(), Some(&[0, 0, 0, 1, 2, 3, 4, 5][..]));
        assert_eq!(p.descs[2].remote_addr, 1200);
        let frames: Vec<(usize, usize, u64)> =
            p.frames.iter().map(|f| (f.start, f.end, f.bytes)).collect();
        assert_eq!(
            frames,
            vec![(0, 1, 100), (1, 2, 100), (2, 5, 70), (5, 7, 20), (7, 8, 90)]
        );
    }
}
