//! Authentication options reach a real server: a token and an nkey are each accepted when
//! right and refused clearly when wrong; mistakes a caller can fix (two methods at once, a
//! seed that is not a user seed, an unreadable credentials file) are typed errors before
//! any server is asked. (User and password: `ports.rs`. TLS: `tls.rs`.)
#![allow(clippy::unwrap_used)]

mod common;

use common::create_bucket;
use tidemark::Source;
use tidemark_nats::{ConnectError, KvBucket, NatsOptions};
use tidemark_tests::{NatsServer, NatsServerOptions};

async fn start(options: NatsServerOptions) -> NatsServer {
    NatsServer::start_with(options)
        .await
        .unwrap_or_else(|e| panic!("a real nats-server is required for these tests: {e}"))
}

/// Connects with `options`, proves JetStream works through the client (a KV write), and
/// returns nothing: the client is dropped.
async fn works(options: &NatsOptions, bucket: &str) {
    let client = options
        .connect()
        .await
        .unwrap_or_else(|e| panic!("the right credentials must connect: {e}"));
    tidemark_tests::wait_jetstream_ready(&client).await.unwrap();
    create_bucket(&client, bucket, 1, 1).await;
    let bucket = KvBucket::new(client, bucket).unwrap();
    assert!(bucket.put("k", b"v".to_vec()).await.unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_accepted_when_right_and_refused_clearly_when_wrong() {
    let server = start(NatsServerOptions::new().arg("--auth").arg("t0ken-right")).await;
    let wrong = NatsOptions::new([server.url()])
        .token("t0ken-wrong")
        .connect()
        .await;
    assert!(
        matches!(wrong, Err(ConnectError::Unauthorized { .. })),
        "a wrong token must be refused as unauthorized, got {wrong:?}"
    );
    let none = NatsOptions::new([server.url()]).connect().await;
    assert!(
        matches!(none, Err(ConnectError::Unauthorized { .. })),
        "no token at all is refused the same way, got {none:?}"
    );
    works(
        &NatsOptions::new([server.url()]).token("t0ken-right"),
        "tok",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_is_accepted_when_right_and_refused_clearly_when_wrong() {
    let user = nkeys::KeyPair::new_user();
    let stranger = nkeys::KeyPair::new_user();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("nkey.conf");
    std::fs::write(
        &config,
        format!(
            "authorization {{\n  users = [\n    {{ nkey: \"{}\" }}\n  ]\n}}\n",
            user.public_key()
        ),
    )
    .unwrap();
    let server = start(NatsServerOptions::new().arg("-c").arg(&config)).await;
    let wrong = NatsOptions::new([server.url()])
        .nkey(stranger.seed().unwrap())
        .connect()
        .await;
    assert!(
        matches!(wrong, Err(ConnectError::Unauthorized { .. })),
        "an nkey the server does not know must be refused as unauthorized, got {wrong:?}"
    );
    works(
        &NatsOptions::new([server.url()]).nkey(user.seed().unwrap()),
        "nkey",
    )
    .await;
}

#[tokio::test]
async fn a_seed_that_is_not_a_user_seed_is_refused_before_connecting() {
    // No server listens here: the error must come from the check, not the network.
    let nowhere = "nats://127.0.0.1:1";
    let garbage = NatsOptions::new([nowhere])
        .nkey("SUnot-a-seed")
        .connect()
        .await;
    assert!(
        matches!(garbage, Err(ConnectError::InvalidNkey { .. })),
        "{garbage:?}"
    );
    let account = nkeys::KeyPair::new_account().seed().unwrap();
    let err = NatsOptions::new([nowhere])
        .nkey(account.clone())
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, ConnectError::InvalidNkey { .. }), "{err:?}");
    assert!(
        !err.to_string().contains(&account),
        "the seed never appears in an error: {err}"
    );
}

#[tokio::test]
async fn two_authentication_methods_at_once_are_refused() {
    let err = NatsOptions::new(["nats://127.0.0.1:1"])
        .user_password("u", "p")
        .token("t")
        .connect()
        .await
        .unwrap_err();
    match err {
        ConnectError::ConflictingAuth { methods } => {
            assert_eq!(methods, "user/password, token");
        }
        other => panic!("expected ConflictingAuth, got {other:?}"),
    }
}

#[tokio::test]
async fn an_unreadable_credentials_file_is_a_typed_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.creds");
    let garbage = dir.path().join("garbage.creds");
    std::fs::write(&garbage, "this is not a creds file").unwrap();
    for file in [missing, garbage] {
        let err = NatsOptions::new(["nats://127.0.0.1:1"])
            .credentials_file(&file)
            .connect()
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ConnectError::Credentials { path, .. } if *path == file),
            "{err:?}"
        );
    }
}
