//! The integration tests of kvferry, one binary (each module was a test
//! binary of its own; one link instead of many).

mod bootstrap;
mod bootstrap_auth;
mod data_plane_messages;
mod e2e_abort_mid;
mod e2e_abort_unrequested;
mod e2e_auth;
mod e2e_aux_state;
mod e2e_both;
mod e2e_device;
mod e2e_faults;
mod e2e_lossy;
mod e2e_mooncake;
mod e2e_pp;
mod e2e_push;
mod e2e_ranks;
mod e2e_string_ids;
mod fuzz_seeds;
mod hostnames;
mod metrics;
mod node_limits;
mod probe_interval;
mod proxy;
mod scheduler;
mod settings;
mod side_channel_auth;
mod transport_auth;
mod transport_device;
mod transport_gpu;
mod transport_local;
mod transport_mooncake;
mod transport_shm;
mod transport_tcp;
mod transport_tcp_spin;
