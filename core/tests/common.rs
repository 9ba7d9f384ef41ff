//! A small harness that owns simulated time and drains the follower after every input.

#![allow(
    dead_code,
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::new_without_default
)]

use std::time::Duration;

use tidemark_core::*;

pub struct H {
    pub f: Follower<Utf8>,
    pub now: Time,
    pub feed: Option<Token>,
    pub request: Option<Token>,
}

pub fn gapless(head: u64) -> FeedInfo {
    FeedInfo::change_log(1, head).with_checkpoints()
}

pub fn sparse(first_available: u64, head: u64) -> FeedInfo {
    FeedInfo::kv(first_available, head)
}

pub fn config() -> FollowerConfigBuilder {
    FollowerConfig::builder("test").seed(1)
}

impl H {
    pub fn new() -> Self {
        Self::with(Follower::new(config().build().unwrap(), Utf8))
    }

    pub fn with(f: Follower<Utf8>) -> Self {
        H {
            f,
            now: Time::ZERO,
            feed: None,
            request: None,
        }
    }

    /// Drains every output, remembering the latest feed and request tokens.
    pub fn drain(&mut self) -> Vec<Output<String>> {
        let mut outs = Vec::new();
        while let Some(o) = self.f.poll_output() {
            match &o {
                Output::Request(Request::OpenFeed { token, .. }) => self.feed = Some(*token),
                Output::Request(Request::LookupSource { token })
                | Output::Request(Request::Reconcile { token, .. })
                | Output::Request(Request::Snapshot { token })
                | Output::Request(Request::Fetch { token, .. })
                | Output::Request(Request::ListKeys { token }) => self.request = Some(*token),
                _ => {}
            }
            outs.push(o);
        }
        outs
    }

    pub fn input(&mut self, input: Input) -> Vec<Output<String>> {
        self.f.handle_input(input, self.now);
        self.drain()
    }

    pub fn found(&mut self) -> Vec<Output<String>> {
        self.drain();
        let token = self.request.expect("a lookup was asked for");
        self.input(Input::SourceFound { token })
    }

    /// Looks up and opens the feed with `info`.
    pub fn open(&mut self, info: FeedInfo) -> Vec<Output<String>> {
        let mut outs = self.found();
        let token = self.feed.expect("the feed was opened");
        outs.extend(self.input(Input::FeedOpened { token, info }));
        outs
    }

    pub fn reopen(&mut self, info: FeedInfo) -> Vec<Output<String>> {
        let token = self.feed.expect("the feed was opened");
        self.input(Input::FeedOpened { token, info })
    }

    /// Answers the fetch in flight: `value` (its seq and text) and the source's watermark
    /// read with it, where the driver knows it.
    pub fn fetched(
        &mut self,
        value: Option<(u64, &str)>,
        source_watermark: Option<u64>,
    ) -> Vec<Output<String>> {
        self.input(Input::Fetched {
            token: self.request.unwrap(),
            value: value.map(|(seq, text)| (seq, text.as_bytes().to_vec())),
            source_watermark,
        })
    }

    pub fn entry(&mut self, entry: Entry) -> Vec<Output<String>> {
        let token = self.feed.expect("a feed is open");
        self.input(Input::Entry { token, entry })
    }

    pub fn put(&mut self, seq: u64, key: &str, value: &str) -> Vec<Output<String>> {
        self.entry(Entry::put(seq, key, value))
    }

    pub fn advance(&mut self, d: Duration) -> Vec<Output<String>> {
        self.now = self.now.saturating_add(d);
        self.f.handle_timeout(self.now);
        self.drain()
    }

    /// Moves time to the follower's next timeout.
    pub fn run_to_timeout(&mut self) -> Vec<Output<String>> {
        let at = self.f.poll_timeout().expect("a timer is armed");
        self.now = at;
        self.f.handle_timeout(at);
        self.drain()
    }
}

pub fn puts(outs: &[Output<String>]) -> Vec<(String, u64, String)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Apply(Apply::Put { key, seq, value }) => {
                Some((key.to_string(), *seq, value.clone()))
            }
            _ => None,
        })
        .collect()
}

pub fn removes(outs: &[Output<String>]) -> Vec<(String, u64)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Apply(Apply::Remove { key, seq }) => Some((key.to_string(), *seq)),
            _ => None,
        })
        .collect()
}

pub fn diagnostics(outs: &[Output<String>]) -> Vec<Diagnostic> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Diagnostic(d) => Some(d.clone()),
            _ => None,
        })
        .collect()
}

pub fn opened_from(outs: &[Output<String>]) -> Option<u64> {
    outs.iter().find_map(|o| match o {
        Output::Request(Request::OpenFeed { from, .. }) => Some(*from),
        _ => None,
    })
}

pub fn is_ready(outs: &[Output<String>]) -> bool {
    outs.iter()
        .any(|o| matches!(o, Output::Notice(Notice::Ready { .. })))
}
