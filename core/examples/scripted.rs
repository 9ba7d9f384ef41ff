//! Drives a follower through a scripted feed — an initial sync, a feed failure, a gap and a
//! compaction — and prints every decision it makes. No I/O: the script plays the source.
//!
//! `cargo run -p tidemark-core --example scripted`

use std::time::Duration;

use tidemark_core::{
    Entry, FeedInfo, Follower, FollowerConfig, Input, Output, Request, Time, Token, Utf8,
};

struct Script {
    f: Follower<Utf8>,
    now: Time,
    feed: Option<Token>,
    request: Option<Token>,
}

impl Script {
    fn say(&mut self, what: &str, input: Option<Input>) {
        println!("\n> {what}");
        if let Some(input) = input {
            self.f.handle_input(input, self.now);
        }
        while let Some(o) = self.f.poll_output() {
            match &o {
                Output::Request(Request::OpenFeed { token, .. }) => self.feed = Some(*token),
                Output::Request(Request::LookupSource { token })
                | Output::Request(Request::Reconcile { token, .. })
                | Output::Request(Request::Snapshot { token })
                | Output::Request(Request::Fetch { token, .. }) => self.request = Some(*token),
                _ => {}
            }
            println!("  {:>8}  {o:?}", self.now.to_string());
        }
        println!(
            "  watermark {} · phase {:?} · keys {}",
            self.f.watermark(),
            self.f.phase(),
            self.f.len()
        );
    }

    fn feed(&self) -> Token {
        self.feed.expect("the follower opened a feed")
    }

    fn request(&self) -> Token {
        self.request.expect("the follower asked for something")
    }

    fn wait_for_timer(&mut self) {
        if let Some(at) = self.f.poll_timeout() {
            self.now = self.now.max(at);
            self.f.handle_timeout(self.now);
            self.say(&format!("time passes to {}", self.now), None);
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = FollowerConfig::builder("scripted").seed(2026).build()?;
    let mut s = Script {
        f: Follower::new(config, Utf8),
        now: Time::ZERO,
        feed: None,
        request: None,
    };
    let gapless =
        |first_available, head| FeedInfo::change_log(first_available, head).with_checkpoints();

    s.say("a new follower starts", None);
    let token = s.request();
    s.say("the source is found", Some(Input::SourceFound { token }));
    let token = s.feed();
    s.say(
        "the feed opens; the source holds 3 mutations",
        Some(Input::FeedOpened {
            token,
            info: gapless(1, 3),
        }),
    );
    for entry in [
        Entry::put(1, "alpha", "1"),
        Entry::put(2, "beta", "2"),
        Entry::put(3, "gamma", "3"),
    ] {
        s.say(
            &format!("entry {} arrives", entry.seq),
            Some(Input::Entry { token, entry }),
        );
    }
    s.say(
        "a value that is not UTF-8 arrives",
        Some(Input::Entry {
            token,
            entry: Entry::new(4, 4, "delta", tidemark_core::Op::Put, vec![0xff]),
        }),
    );
    s.say(
        "the connection drops",
        Some(Input::FeedFailed {
            token,
            error: "connection reset".into(),
        }),
    );
    s.wait_for_timer();
    let token = s.feed();
    s.say(
        "the feed reopens",
        Some(Input::FeedOpened {
            token,
            info: gapless(1, 7),
        }),
    );
    s.say(
        "entry 7 arrives: 5 and 6 are missing",
        Some(Input::Entry {
            token,
            entry: Entry::put(7, "beta", "7"),
        }),
    );
    let token = s.request();
    let changes = vec![
        Entry::delete(5, "alpha"),
        Entry::put(6, "epsilon", "6"),
        Entry::put(7, "beta", "7"),
    ];
    s.say(
        "the source answers the reconcile",
        Some(Input::Changes {
            token,
            changes,
            source_watermark: 7,
        }),
    );
    let token = s.feed();
    s.say(
        "the feed reopens past the gap",
        Some(Input::FeedOpened {
            token,
            info: gapless(1, 7),
        }),
    );
    s.say(
        "the server restarts: the feed ends",
        Some(Input::FeedEnded { token }),
    );
    s.now = s.now.saturating_add(Duration::from_secs(1));
    s.wait_for_timer();
    let token = s.feed();
    s.say(
        "history up to 20 was compacted meanwhile",
        Some(Input::FeedOpened {
            token,
            info: gapless(21, 22),
        }),
    );
    let token = s.request();
    let entries = vec![Entry::put(21, "beta", "21"), Entry::put(22, "zeta", "22")];
    s.say(
        "the snapshot arrives",
        Some(Input::Snapshot {
            token,
            entries,
            source_watermark: 22,
        }),
    );
    println!("\nfinal counters: {:?}", s.f.counters());
    Ok(())
}
