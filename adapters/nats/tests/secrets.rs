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

/// Passwords holding what a URL parser takes for the end of the authority (`/`, `?`,
/// `#`) or of the userinfo (`@`), a `:`, or a `%`, written as they are and
/// percent-encoded: each pair is the URL's password as written and the password it
/// stands for.
const AWKWARD_PASSWORDS: [(&str, &str); 10] = [
    ("s3cr#t-pw", "s3cr#t-pw"),
    ("s3cr?t-pw", "s3cr?t-pw"),
    ("s3cr/t-pw", "s3cr/t-pw"),
    ("s3cr@t-pw", "s3cr@t-pw"),
    ("s3cr:t-pw", "s3cr:t-pw"),
    ("s3cr%t-pw", "s3cr%t-pw"),
    ("s3/c?r#e@t:%-pw", "s3/c?r#e@t:%-pw"),
    ("s3cr%23t-pw", "s3cr#t-pw"),
    ("s3cr%2Ft%3Fx%40y-pw", "s3cr/t?x@y-pw"),
    ("s3cr%3At%25-pw", "s3cr:t%-pw"),
];

fn assert_hidden(what: &str, written: &str, meant: &str, text: &str) {
    for secret in [written, meant] {
        assert!(
            !text.contains(secret),
            "{what} must not show the password {written:?}: {text}"
        );
    }
    // Neither a piece a parser might have cut off at a delimiter.
    assert!(
        !text.contains("s3cr") && !text.contains("s3/c"),
        "{what} shows part of the password {written:?}: {text}"
    );
}

#[test]
fn debug_hides_a_url_password_holding_url_delimiters() {
    for (written, meant) in AWKWARD_PASSWORDS {
        let mut urls = vec![
            format!("nats://mirror:{written}@127.0.0.1:4222"),
            format!("mirror:{written}@127.0.0.1:4222"),
        ];
        // As a token: one with a `:` is a user and password by the URL's own rules.
        if !written.contains(':') {
            urls.push(format!("tls://{written}@127.0.0.1:4222"));
        }
        for url in urls {
            let debug = format!("{:?}", NatsOptions::new([url.clone()]));
            assert_hidden("Debug of NatsOptions", written, meant, &debug);
            assert!(
                debug.contains("<redacted>@127.0.0.1:4222"),
                "{url}: the server stays visible: {debug}"
            );
        }
    }
}

#[tokio::test]
async fn a_failed_connect_hides_a_url_password_holding_url_delimiters() {
    let port = closed_port();
    for (written, meant) in AWKWARD_PASSWORDS {
        let url = format!("nats://mirror:{written}@127.0.0.1:{port}");
        let error = NatsOptions::new([url])
            .connection_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect_err("nothing listens on the port");
        let shown = error.to_string();
        assert_hidden("a connection error", written, meant, &shown);
        assert_hidden(
            "Debug of a connection error",
            written,
            meant,
            &format!("{error:?}"),
        );
        assert!(
            shown.contains(&format!("mirror:<redacted>@127.0.0.1:{port}"))
                && shown.contains("refused"),
            "the error names the server and the real failure (no URL misread): {shown}"
        );
    }
}

/// Random passwords of printable ASCII (space to `~`), `Debug` of options and the error
/// of a failed connect: never the password. A fixed seed, so a failure repeats (the
/// crate has no proptest; this is its property test by hand).
#[tokio::test]
async fn random_printable_passwords_never_show() {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let port = closed_port();
    for case in 0..400 {
        // 12 to 27 characters: long enough not to turn up in the rest of the text by chance.
        let len = 12 + usize::try_from(next() % 16).unwrap();
        let password: String = (0..len)
            .map(|_| char::from(b' ' + u8::try_from(next() % 95).unwrap()))
            .collect();
        let url = format!("nats://mirror:{password}@127.0.0.1:{port}");
        let options = NatsOptions::new([url.clone()]).connection_timeout(Duration::from_secs(2));
        let debug = format!("{options:?}");
        assert!(
            !debug.contains(&password),
            "{password:?}: Debug shows it: {debug}"
        );
        // Connect for a share of them: each is a round trip to the closed port.
        if case % 10 == 0 {
            let error = options.connect().await.expect_err("nothing listens");
            for shown in [error.to_string(), format!("{error:?}")] {
                assert!(
                    !shown.contains(&password),
                    "{password:?}: the connect error shows it: {shown}"
                );
                assert!(
                    shown.contains(&format!("127.0.0.1:{port}")),
                    "{password:?}: the error names the server: {shown}"
                );
            }
        }
    }
}
