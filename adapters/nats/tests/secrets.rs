//! Secrets in server URLs (`user:password@`, `token@`) never reach `Debug` output, error
//! messages or logs (SPEC §15): a connection string pasted into configuration must not leak
//! the password into every log line that names the server.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tidemark_nats::NatsOptions;

#[path = "common/secrets.rs"]
mod secrets;

use secrets::{assert_no_secret, closed_port, urls};

#[test]
fn debug_of_options_hides_passwords_and_tokens_in_urls() {
    let options = NatsOptions::new(urls(4222)).name("mirror");
    let debug = format!("{options:?}");
    assert_no_secret("Debug of NatsOptions", &debug);
    assert!(
        debug.contains("nats://mirror:<redacted>@127.0.0.1:4222")
            && debug.contains("nats://<redacted>@127.0.0.1:4222"),
        "the user and the server stay visible, for diagnosis: {debug}"
    );
}

#[tokio::test]
async fn a_failed_connect_names_the_server_but_not_its_password() {
    let port = closed_port();
    for url in urls(port) {
        let error = NatsOptions::new([url.clone()])
            .connection_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect_err("nothing listens on the port");
        let shown = error.to_string();
        assert_no_secret("a connection error", &shown);
        assert_no_secret("Debug of a connection error", &format!("{error:?}"));
        assert!(
            shown.contains(&format!("127.0.0.1:{port}")),
            "the error still says which server failed: {shown}"
        );
    }
}
