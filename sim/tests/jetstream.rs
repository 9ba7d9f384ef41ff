//! The source host's JetStream bucket over the sim's wire, read by a follower's client
//! (`RemoteKv`) while a writer overwrites keys: a snapshot ended by tidemark-jetstream's
//! `Replay` is the source's state at its watermark every time; one ended on the
//! consumer's pending count is not, and the search below must find it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark::Source;
use tidemark_memory::Memory;
use tidemark_sim::checks::jobs::JobLedger;
use tidemark_sim::checks::oracle::{FeedSkips, History, RelayLedger};
use tidemark_sim::clients::kv::RemoteKv;
use tidemark_sim::clients::remote::Remote;
use tidemark_sim::hosts::jetstream::JetStream;
use tidemark_sim::hosts::source::{self as server, SourceHost, WriteGate};
use tidemark_sim::hosts::sweeps::Sweeps;
use tidemark_sim::scenario::SOURCE;
use tidemark_sim::trace::Trace;

/// What the reader found: snapshots read, and for each one that was not the source's
/// state at its watermark, what differed.
#[derive(Debug, Default)]
struct Reads {
    snapshots: usize,
    wrong: Vec<String>,
}

/// A source host with 12 keys, a writer overwriting 4 of them every 10 to 40 ms, and a
/// reader taking snapshots of the bucket one delivery at a time for 20 simulated seconds.
fn snapshots_while_overwriting(seed: u64, trusting_pending: bool) -> Reads {
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(30))
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(20))
        .build();
    let memory = Memory::new();
    let history = History::default();
    let base = tokio::time::Instant::now();
    let clock = move || base + turmoil::sim_elapsed().unwrap_or_default();
    let host = SourceHost {
        sweeps: Sweeps::new(&memory, clock, Vec::new(), history.clone()),
        memory,
        history: history.clone(),
        ledger: RelayLedger::default(),
        jobs: JobLedger::default(),
        jetstream: JetStream::new(seed, FeedSkips::default()),
        silence: server::Silence::default(),
    };
    let gate = WriteGate::new(Trace::new(false));
    sim.host(SOURCE, move || server::serve(host.clone(), gate.clone()));
    sim.client("writer", async move {
        let remote = Remote::new(SOURCE);
        for k in 0..12 {
            remote.put(&format!("k{k}"), b"0".to_vec()).await?;
        }
        let mut rng = tidemark::tidemark_core::Rng::new(seed);
        for n in 1u64.. {
            if turmoil::sim_elapsed().unwrap_or_default() > Duration::from_secs(21) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10 + rng.next_u64() % 30)).await;
            let key = format!("k{}", rng.next_u64() % 4);
            let _ = remote.put(&key, n.to_string().into_bytes()).await;
        }
        Ok(())
    });
    let reads: Arc<Mutex<Reads>> = Arc::default();
    let seen = Arc::clone(&reads);
    sim.client("reader", async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let kv = RemoteKv::new(Remote::new(SOURCE), "reader", 1);
        let kv = if trusting_pending {
            kv.trusting_pending()
        } else {
            kv
        };
        while turmoil::sim_elapsed().unwrap_or_default() < Duration::from_secs(20) {
            let Ok(snapshot) = kv.snapshot().await else {
                continue;
            };
            let cache: BTreeMap<String, (u64, String)> = snapshot
                .entries
                .into_iter()
                .map(|e| {
                    let value = String::from_utf8_lossy(&e.value).into_owned();
                    (e.key.to_string(), (e.seq, value))
                })
                .collect();
            let diff = history.inconsistencies(&cache, snapshot.watermark, &|_| false);
            let mut r = seen.lock().unwrap_or_else(|e| e.into_inner());
            r.snapshots += 1;
            if !diff.is_empty() {
                r.wrong
                    .push(format!("at {}: {}", snapshot.watermark, diff.join("; ")));
            }
        }
        Ok(())
    });
    sim.run().expect("the hosts run");
    Arc::try_unwrap(reads)
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
        .unwrap_or_default()
}

#[test]
fn a_snapshot_ended_by_a_read_that_cannot_race_is_the_source_at_its_watermark() {
    for seed in 0..4 {
        let reads = snapshots_while_overwriting(seed, false);
        assert!(
            reads.snapshots > 20,
            "seed {seed}: only {} snapshots were read",
            reads.snapshots
        );
        assert!(
            reads.wrong.is_empty(),
            "seed {seed}: a snapshot missed a key overwritten while it was read: {:?}",
            reads.wrong
        );
    }
}

#[test]
fn a_snapshot_ended_on_the_pending_count_is_caught_missing_a_key() {
    let (mut read, mut wrong) = (0, 0);
    for seed in 0..4 {
        let reads = snapshots_while_overwriting(seed, true);
        read += reads.snapshots;
        wrong += reads.wrong.len();
    }
    assert!(
        wrong > 0,
        "none of {read} snapshots that trust the pending count missed a key: the race is not run"
    );
    eprintln!("{wrong} of {read} snapshots that trust the pending count missed a key");
}
