//! Thread-per-core glommio executors that drive kvferry's state machines
//! (filled by the reactor work).
