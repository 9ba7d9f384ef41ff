//! TLS options reach async-nats: a server with TLS is reached with the right CA, refused
//! with a clear TLS error without it, and mutual TLS presents a client certificate.
#![allow(clippy::unwrap_used, clippy::missing_panics_doc)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tidemark_nats::{ConnectError, NatsOptions};
use tidemark_tests::{NatsServer, NatsServerOptions};

struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).unwrap();
    path
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, all made here.
fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server_cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let client_key = KeyPair::generate().unwrap();
    let client_cert = CertificateParams::new(vec!["tidemark-client".to_owned()])
        .unwrap()
        .signed_by(&client_key, &issuer)
        .unwrap();
    Pki {
        ca: write(dir.path(), "ca.pem", &ca_cert.pem()),
        server_cert: write(dir.path(), "server.pem", &server_cert.pem()),
        server_key: write(dir.path(), "server-key.pem", &server_key.serialize_pem()),
        client_cert: write(dir.path(), "client.pem", &client_cert.pem()),
        client_key: write(dir.path(), "client-key.pem", &client_key.serialize_pem()),
        _dir: dir,
    }
}

async fn tls_server(pki: &Pki, verify_clients: bool) -> NatsServer {
    let mut options = NatsServerOptions::new()
        .arg("--tls")
        .arg("--tlscert")
        .arg(pki.server_cert.as_os_str())
        .arg("--tlskey")
        .arg(pki.server_key.as_os_str());
    if verify_clients {
        options = options
            .arg("--tlsverify")
            .arg("--tlscacert")
            .arg(pki.ca.as_os_str());
    }
    match NatsServer::start_with(options).await {
        Ok(s) => s,
        Err(e) => panic!("a real nats-server is required for these tests: {e}"),
    }
}

fn url(server: &NatsServer) -> String {
    format!("tls://127.0.0.1:{}", server.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_the_right_ca_connects_and_without_it_is_a_clear_tls_error() {
    let pki = pki();
    let server = tls_server(&pki, false).await;
    let client = NatsOptions::new([url(&server)])
        .ca_certificate(&pki.ca)
        .require_tls(true)
        .connection_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("the right CA must be accepted");
    client.flush().await.expect("a round trip over TLS");

    let refused = NatsOptions::new([url(&server)])
        .require_tls(true)
        .connection_timeout(Duration::from_secs(5))
        .connect()
        .await;
    match refused {
        Err(e @ ConnectError::Tls { .. }) => {
            assert!(
                e.to_string().contains("TLS"),
                "the error must say it is TLS: {e}"
            );
        }
        other => panic!("a server certificate from an unknown CA must fail as TLS: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let pki = pki();
    let server = tls_server(&pki, true).await;
    let client = NatsOptions::new([url(&server)])
        .ca_certificate(&pki.ca)
        .client_certificate(&pki.client_cert, &pki.client_key)
        .connection_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("a client certificate from the CA must be accepted");
    client.flush().await.expect("a round trip over mutual TLS");

    let refused = NatsOptions::new([url(&server)])
        .ca_certificate(&pki.ca)
        .connection_timeout(Duration::from_secs(5))
        .connect()
        .await;
    assert!(
        refused.is_err(),
        "without a client certificate the server must refuse"
    );
}
