//! Retention on NATS: the events stream is created with limits, and a sweep puts limits on
//! a stream created without them; the server then keeps it bounded.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

mod common;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use tidemark::{Publish, Sweep};
use tidemark_nats::{NatsEvents, NatsSweep, StreamLimits};

use common::*;

/// The fence of a sweep run by hand, outside the sweeper lock (never taken here).
fn fence() -> tidemark::LockLease {
    tidemark::LockLease {
        name: tidemark::SWEEP_LOCK.into(),
        owner: "test".into(),
        fencing: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_events_stream_is_created_with_the_default_limits() {
    let server = server().await;
    let client = client(&server).await;
    let events = NatsEvents::new(client.clone(), "EVENTS", "events").unwrap();
    events.ensure(1).await.unwrap();
    let js = jetstream::new(client);
    let mut s = js.get_stream("EVENTS").await.unwrap();
    let config = s.info().await.unwrap().config.clone();
    assert_eq!(
        (config.max_age, config.max_bytes, config.max_messages),
        (
            StreamLimits::EVENTS.max_age,
            StreamLimits::EVENTS.max_bytes,
            StreamLimits::EVENTS.max_messages
        ),
        "a new events stream is bounded from the start"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_bounds_a_stream_created_without_limits() {
    let server = server().await;
    let client = client(&server).await;
    let js = jetstream::new(client.clone());
    // As an older tidemark created it: no limits.
    js.create_stream(stream::Config {
        name: "OLD".into(),
        subjects: vec!["old.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let events = NatsEvents::new(client.clone(), "OLD", "old").unwrap();
    for i in 0..100 {
        events
            .publish(&format!("k{i}"), b"{}".to_vec())
            .await
            .unwrap();
    }
    let limits = StreamLimits {
        max_age: Duration::from_secs(3600),
        max_bytes: -1,
        max_messages: 10,
    };
    let sweep = NatsSweep::new(client.clone()).events("OLD", limits);
    let swept = sweep.sweep(&fence()).await.unwrap();
    assert_eq!(swept.events, 90, "the oldest go, down to the limit");
    for i in 0..50 {
        events
            .publish(&format!("n{i}"), b"{}".to_vec())
            .await
            .unwrap();
    }
    let mut s = js.get_stream("OLD").await.unwrap();
    let info = s.info().await.unwrap();
    assert_eq!(
        info.state.messages, 10,
        "the server keeps it bounded from then on"
    );
    assert_eq!(info.state.last_sequence, 150, "nothing new was refused");
    assert_eq!(
        sweep.sweep(&fence()).await.unwrap().events,
        0,
        "limits in place: nothing to do"
    );
}
