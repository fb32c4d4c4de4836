//! Configuration of a reactor and its executors.

use std::time::Duration;

use crate::error::ReactorError;

/// One executor: one device's thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutorConfig {
    /// Thread name prefix (e.g. `"dev0"`).
    pub label: String,
    /// Core to pin the executor to (`Placement::Fixed`), or `None` to let
    /// the OS place it (`Placement::Unbound`).
    pub core: Option<usize>,
}

impl ExecutorConfig {
    /// An executor pinned to `core`.
    pub fn pinned(label: impl Into<String>, core: usize) -> Self {
        Self {
            label: label.into(),
            core: Some(core),
        }
    }

    /// An executor the OS places.
    pub fn unpinned(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            core: None,
        }
    }
}

/// How something idle waits, the latency/CPU trade-off: an executor with
/// nothing to do ([`ReactorConfig::poll_policy`]), or a data-plane endpoint
/// waiting for a socket (`kvferry::transport::TcpConfig::poll`).
///
/// Parking costs a thread wake-up per round trip (80-110 µs on small VMs);
/// spinning costs a core but answers in ~20 µs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollPolicy {
    /// Sleep in the kernel as soon as there is nothing to do. Cheapest on
    /// CPU; a wake-up from another thread costs a context switch.
    Park,
    /// Busy-poll for up to `spin` before sleeping. Costs a core while
    /// spinning; cuts wake-up latency when work arrives within `spin`. An
    /// executor spins in glommio (`spin_before_park`); a socket is tried
    /// without blocking for `spin` after the last byte moved, the executor
    /// polling its rings and running what that woke between two tries.
    /// [`Duration::MAX`] never parks.
    Spin {
        /// How long to spin before parking.
        spin: Duration,
    },
}

impl Default for PollPolicy {
    /// Spinning for a millisecond keeps back-to-back work (an executor's
    /// next input, a socket's next response) on the fast path while an idle
    /// waiter still parks quickly. Where cores are shared, spinning starves
    /// the other threads on them, so [`ReactorConfig`] and the node's data
    /// plane choose [`PollPolicy::Park`] by default instead.
    fn default() -> Self {
        PollPolicy::Spin {
            spin: Duration::from_millis(1),
        }
    }
}

impl PollPolicy {
    /// The policy to run with `cpus` CPUs allowed to the process: a spin
    /// parks on one CPU, where the spinner would keep the very thread it
    /// waits for (the socket's other end, the executor that answers) off
    /// the only core (measured: tcp 1 MiB × 32 on `taskset -c 0` reached
    /// 0.78 × iperf3 spinning against 1.03 × parked).
    pub fn for_cpus(self, cpus: usize) -> PollPolicy {
        match self {
            PollPolicy::Spin { .. } if cpus <= 1 => PollPolicy::Park,
            PollPolicy::Spin { .. } | PollPolicy::Park => self,
        }
    }

    /// [`PollPolicy::for_cpus`] with the CPUs this process may run on: the
    /// affinity mask of its main thread, as `taskset` sets it. Not the
    /// calling thread's, which is one CPU in an executor pinned to its
    /// core. A system call: call it once per transport or executor, not
    /// per wait.
    pub fn for_this_process(self) -> PollPolicy {
        self.for_cpus(process_cpus())
    }
}

/// CPUs in the main thread's affinity mask; 1 if it cannot be read.
fn process_cpus() -> usize {
    // SAFETY: `set` is a plain bitmask the call fills; the size passed is
    // its own; the pid names this process's main thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        if libc::sched_getaffinity(libc::getpid(), size, &mut set) != 0 {
            return 1;
        }
        libc::CPU_COUNT(&set).max(1) as usize
    }
}

/// What to do with requests still in flight at shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShutdownPolicy {
    /// Abort every live request with `AbortReason::Shutdown` at once, then
    /// give the machines up to `grace` to finish (send aborts, wait for
    /// acknowledgements and fences). What is left after that is dropped.
    Abort {
        /// Time allowed after the aborts.
        grace: Duration,
    },
    /// Let live requests run to completion for up to `drain`, then abort
    /// what is left and give it up to `grace`. New requests are refused
    /// from the start.
    Drain {
        /// Time allowed to finish normally.
        drain: Duration,
        /// Time allowed after the aborts.
        grace: Duration,
    },
}

/// Configuration of a [`crate::Reactor`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReactorConfig {
    /// One entry per device, in device order.
    pub executors: Vec<ExecutorConfig>,
    /// Commands an executor's mailbox holds before submissions are refused
    /// with `SubmitError::MailboxFull`.
    pub mailbox_capacity: usize,
    /// Transfers one executor holds (live plus finished and not yet
    /// collected with `get_finished`) before creations are refused with
    /// `SubmitError::AtCapacity`.
    pub max_machines_per_executor: usize,
    /// Actions drained from one machine per input before moving on.
    pub max_actions_per_input: usize,
    /// Mailbox and local events handled per loop turn before timers run
    /// again; bounds how long timers can wait behind a burst of input.
    pub max_inputs_per_turn: usize,
    /// Capacity of the executor-local queue async actions report through.
    pub local_event_capacity: usize,
    /// Deadline granularity: deadlines in the same tick share one timer
    /// wake-up, and every machine is woken at most one tick (plus the
    /// executor's own wake-up delay) after its deadline.
    pub timer_tick: Duration,
    /// How idle executors wait.
    pub poll_policy: PollPolicy,
    /// glommio's registered IO memory per executor. Kept small by default
    /// because these machines allow only 8 MiB of locked memory in total.
    pub io_memory_bytes: usize,
    /// How long `Reactor::start` waits for every executor to come up.
    pub start_timeout: Duration,
    /// Policy used when a `Reactor` is dropped without `shutdown`.
    pub drop_policy: ShutdownPolicy,
    /// After a turn in which requests ended, with fewer than this many
    /// requests left live on the executor, give the core away once
    /// (`sched_yield`) before the executor's other tasks run, so an engine
    /// thread woken for them on the same core runs first instead of after
    /// the acknowledgements and answers this executor sends next (and the
    /// peer those wake). 0 (the default) never yields. Worth it where the
    /// engine waits for the requests that end (a decode node: 0.12 → 0.095
    /// ms at p50 for a small request one at a time with the demo's process
    /// on one core); with many requests in flight a yield per turn only
    /// adds context switches (12 % fewer small requests/s with 256 in
    /// flight), hence the bound. Costs one system call when nothing else is
    /// runnable.
    pub yield_after_ends_below: usize,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        Self {
            executors: vec![ExecutorConfig::unpinned("kvferry-dev0")],
            mailbox_capacity: 4_096,
            max_machines_per_executor: 16_384,
            max_actions_per_input: 1_024,
            max_inputs_per_turn: 256,
            local_event_capacity: 4_096,
            timer_tick: Duration::from_millis(1),
            poll_policy: PollPolicy::Park,
            io_memory_bytes: 512 * 1024,
            start_timeout: Duration::from_secs(10),
            drop_policy: ShutdownPolicy::Abort {
                grace: Duration::from_secs(2),
            },
            yield_after_ends_below: 0,
        }
    }
}

impl ReactorConfig {
    /// One executor per device: device `i` pinned to core `i` while there
    /// are cores, unpinned beyond that (a node may serve more devices than
    /// the machine has cores).
    pub fn for_devices(devices: usize) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let executors = (0..devices)
            .map(|device| {
                let label = format!("kvferry-dev{device}");
                if device < cores {
                    ExecutorConfig::pinned(label, device)
                } else {
                    ExecutorConfig::unpinned(label)
                }
            })
            .collect();
        Self {
            executors,
            ..Self::default()
        }
    }

    /// Checks the limits; every one must be positive.
    pub fn validate(&self) -> Result<(), ReactorError> {
        let bad = |what: &'static str| Err(ReactorError::Config(what));
        if self.executors.is_empty() {
            return bad("at least one executor is required");
        }
        if self.mailbox_capacity == 0 {
            return bad("mailbox_capacity must be positive");
        }
        if self.max_machines_per_executor == 0 {
            return bad("max_machines_per_executor must be positive");
        }
        if self.max_actions_per_input == 0 {
            return bad("max_actions_per_input must be positive");
        }
        if self.max_inputs_per_turn == 0 {
            return bad("max_inputs_per_turn must be positive");
        }
        if self.local_event_capacity == 0 {
            return bad("local_event_capacity must be positive");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spin_parks_on_one_cpu_and_spins_on_more() {
        let spin = PollPolicy::Spin {
            spin: Duration::from_millis(1),
        };
        assert_eq!(spin.for_cpus(1), PollPolicy::Park);
        assert_eq!(spin.for_cpus(0), PollPolicy::Park);
        assert_eq!(spin.for_cpus(2), spin);
        assert_eq!(PollPolicy::Park.for_cpus(8), PollPolicy::Park);
    }

    #[test]
    fn the_process_cpus_are_the_main_threads_not_a_pinned_threads() {
        let main = process_cpus();
        // A thread pinned to one CPU still sees the process's count.
        let seen = std::thread::spawn(|| {
            // SAFETY: a zeroed mask with CPU 0 set, for this thread only.
            unsafe {
                let mut one: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut one);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one);
            }
            process_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(seen, main);
    }
}
