//! The checks: the [`oracle`] (the source's full history, the followers' probes, the
//! relays' ledger) and the ledgers of the job runners ([`jobs`]) and the sweeps
//! ([`sweeps`]). They read only what the world and the hosts record into them, and import
//! nothing of the simulator but the trace and the scenario's settings.

pub mod jobs;
pub mod oracle;
pub mod sweeps;
