//! The integration tests of kvferry-cli, one binary (each module was a test
//! binary of its own; one link instead of many).

mod bench_baseline;
mod bench_device;
mod bootstrap_cli;
mod cli_usage;
mod e2e_cli;
mod e2e_hostnames;
mod e2e_kill;
mod e2e_mooncake_real;
mod e2e_ranks;
mod e2e_soak;
mod plan_cli;
mod store_kill;
mod stores;
