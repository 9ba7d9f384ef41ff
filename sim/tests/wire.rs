//! The simulated network under the sim's protocol: what a frame costs on the wire, and the
//! vendored turmoil's delivery (patched to visit only a host's own links) on a full mesh.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::rc::Rc;
use std::time::Duration;

use tidemark_sim::wire::{self, FrameReader, Request};
use turmoil::net::{TcpListener, TcpStream};
use turmoil::{Protocol, Segment};

const PORT: u16 = 7100;

/// A frame written by `wire::write` travels as one data segment holding the length and
/// the body: one latency draw, one delivery, one wake of the reader.
#[test]
fn a_frame_crosses_the_network_as_one_segment() {
    let mut sim = turmoil::Builder::new()
        .min_message_latency(Duration::from_millis(200))
        .max_message_latency(Duration::from_millis(200))
        .build();
    sim.host("server", || async {
        let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT)).await?;
        let (stream, _) = listener.accept().await?;
        let mut frames = FrameReader::new(stream);
        let _: Request = frames.read().await?;
        std::future::pending::<()>().await;
        Ok(())
    });
    sim.client("client", async {
        let mut stream = TcpStream::connect(("server", PORT)).await?;
        wire::write(&mut stream, &Request::Watermark).await?;
        // Stay connected until the test has seen the segment arrive.
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(())
    });
    let body = wire::encode(&Request::Watermark).expect("a request serializes");
    // Every data segment seen in flight from the client, by its sequence number.
    let mut data: BTreeMap<u64, usize> = BTreeMap::new();
    let client: IpAddr = sim.lookup("client");
    while !sim.step().expect("the hosts run") {
        sim.links(|links| {
            for link in links {
                for sent in link {
                    let (src, _) = sent.pair();
                    if let Protocol::Tcp(Segment::Data(seq, bytes)) = sent.protocol()
                        && src.ip() == client
                    {
                        data.insert(*seq, bytes.len());
                    }
                }
            }
        });
    }
    assert_eq!(
        data.values().copied().collect::<Vec<_>>(),
        vec![4 + body.len()],
        "one segment with the length and the body, not one for each"
    );
}

/// Every host of a full mesh talks to every other in the same steps, both ways at once on
/// each link; each gets every frame sent to it, in the order of its connections, and the
/// same seed gives the same order of receipt.
#[test]
fn every_host_of_a_mesh_gets_what_was_sent_to_it_in_a_seeded_order() {
    let first = mesh_receipts(7);
    let hosts = 6;
    assert_eq!(first.len(), hosts * (hosts - 1), "{first:?}");
    for to in 0..hosts {
        let mut from: Vec<usize> = first
            .iter()
            .filter(|(t, _)| *t == to)
            .map(|(_, f)| *f)
            .collect();
        from.sort_unstable();
        let others: Vec<usize> = (0..hosts).filter(|h| *h != to).collect();
        assert_eq!(from, others, "host {to} got frames from {from:?}");
    }
    assert_eq!(mesh_receipts(7), first, "the same seed, another order");
}

/// Runs a mesh of six hosts, each sending one frame to every other at the same instant;
/// returns (receiver, sender) in the order the frames were read.
fn mesh_receipts(seed: u64) -> Vec<(usize, usize)> {
    let hosts = 6;
    let got: Rc<RefCell<Vec<(usize, usize)>>> = Rc::default();
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(30))
        .build();
    for me in 0..hosts {
        let got = Rc::clone(&got);
        sim.host(format!("h{me}"), move || {
            let got = Rc::clone(&got);
            async move {
                let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT)).await?;
                // Let every host bind before anyone connects.
                tokio::time::sleep(Duration::from_millis(50)).await;
                for peer in (0..hosts).filter(|p| *p != me) {
                    tokio::task::spawn_local(async move {
                        let mut stream = TcpStream::connect((format!("h{peer}"), PORT)).await?;
                        let hello = Request::Get {
                            key: me.to_string(),
                        };
                        wire::write(&mut stream, &hello).await?;
                        std::future::pending::<()>().await;
                        Ok::<(), std::io::Error>(())
                    });
                }
                loop {
                    let (stream, _) = listener.accept().await?;
                    let got = Rc::clone(&got);
                    tokio::task::spawn_local(async move {
                        let mut frames = FrameReader::new(stream);
                        if let Ok(Request::Get { key }) = frames.read().await {
                            let from: usize = key.parse().unwrap_or(usize::MAX);
                            got.borrow_mut().push((me, from));
                        }
                        std::future::pending::<()>().await;
                    });
                }
            }
        });
    }
    for _ in 0..200 {
        sim.step().expect("the hosts run");
    }
    got.take()
}
