//! The follower: decides how a cache stays converged with its source.
//!
//! One idea a file: [`io`] what goes in and out, [`status`] what an operator sees,
//! [`index`] the key index and its undo log, [`timers`] the backoff deadlines, and
//! [`apply`] how entries, reconciles and snapshots change the cache, [`parts`] what a
//! snapshot read in parts keeps until its last part, [`cached`] how a new history's parts
//! compare with what the sink holds, [`switch`] a snapshot's puts decided as they are
//! taken, [`feed`] the feed's
//! life, [`handle`] the dispatch of inputs and timeouts, [`confirm`] announcements awaiting
//! the source's confirmation, [`vanishing`] what a source drops without a message. This file holds the machine
//! itself: its state, constructors, getters, mutators and requests.

mod apply;
mod cached;
mod confirm;
mod feed;
mod handle;
mod index;
mod io;
mod lineage;
mod parts;
mod status;
mod switch;
mod timers;
mod vanishing;

use std::collections::VecDeque;

use crate::backoff::Backoff;
use crate::config::FollowerConfig;
use crate::decode::Decode;
use crate::entry::Entry;
use crate::lineage::Lineage;
use crate::prefix::KeyPrefix;
use crate::rng::Rng;
use crate::time::Time;

pub use cached::Cached;
pub use confirm::Ahead;
pub use io::{
    Apply, CaughtUp, Continuity, FeedInfo, Follow, Input, Notice, Output, Request, Token,
};
pub use status::{Cause, Counters, Diagnostic, InvalidReason, Phase, Status};

use index::KeyIndex;
use timers::{Pending, Timers};

/// Feed items buffered while a request is outstanding, at most.
const MAX_HELD: usize = 4096;

/// Where the follower is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Looking the source up.
    Starting,
    /// The source was found; the initial sync is underway.
    Syncing,
    /// Ready: the cache held every current entry of the source at some point.
    Live,
    /// Stopped; `ready` says whether it had become ready.
    Stopped { ready: bool },
}

/// The feed, once asked for.
#[derive(Clone, Debug)]
struct FeedState {
    token: Token,
    from: u64,
    /// What it reported when it opened; `None` while it opens.
    info: Option<FeedInfo>,
    /// The highest seq it delivered.
    last_seq: u64,
}

/// A feed item that arrived while a request was outstanding.
#[derive(Clone, Debug)]
enum Held {
    Entry(Entry),
    Undecodable {
        position: u64,
        seq: Option<u64>,
        reason: String,
    },
    /// The feed's head moved up.
    Head(u64),
    /// A marker whose fetch read the key older than the marker from a source whose head had
    /// passed it (or was not known): judged again once the read of the whole source asked
    /// for then is in. Covered by that read (its seq at or below the watermark), it is
    /// settled by it; otherwise the key is fetched again, `stale` reads in.
    Refetch {
        key: String,
        seq: u64,
        position: u64,
        stale: u32,
    },
}

/// The state the sink last committed: where a [`Input::SinkFailed`] goes back to.
#[derive(Clone, Copy, Debug, Default)]
struct Mark {
    watermark: u64,
    ready: bool,
    checkpoint: Option<u64>,
    known: lineage::Known,
}

#[derive(Debug)]
struct Backoffs {
    lookup: Backoff,
    failure: Backoff,
    end: Backoff,
    /// A marker's fetch that read the source before the marker's change: a replica
    /// catching up, or a marker no history of this source made. Its own count, so that
    /// the few reads that tell which are not spaced by a backoff an outage grew.
    stale: Backoff,
    /// A durable cursor's saves that failed: their own count, so that a cursor store
    /// away does not space the source's retries, nor they its saves.
    checkpoint: Backoff,
}

/// The sans-IO follower state machine.
///
/// It decides; it never does. The driver reports facts with
/// [`handle_input`](Self::handle_input) and [`handle_timeout`](Self::handle_timeout), and
/// carries out decisions taken from [`poll_output`](Self::poll_output).
///
/// **The driving contract:** after every input or timeout, drain `poll_output` until it
/// returns `None`, carrying out each output in order; then sleep until
/// [`poll_timeout`](Self::poll_timeout) ([`timeout_cause`](Self::timeout_cause) says which
/// backoff that deadline ends). Results of requests (open, reconcile, snapshot, fetch) are
/// reported with the token the request carried.
///
/// **Durable sinks:** a driver whose sink can fail or commits in batches calls
/// [`track_commits`](Self::track_commits) once, [`commit`](Self::commit) after each batch
/// the sink committed, and reports [`Input::SinkFailed`] when a batch could not be applied
/// or committed: the follower then goes back to the last commit and decides everything
/// since again. A sink that already holds a cache (a warm start) is resumed with
/// [`resume`](Self::resume) or [`resume_lazily`](Self::resume_lazily).
///
/// Methods come in four families: getters (`&self`), `handle_*` (a fact arrived),
/// mutators (`commit`, `remember`, …) and `poll_*` (the next decision).
#[derive(Debug)]
pub struct Follower<D: Decode> {
    config: FollowerConfig,
    decoder: D,
    follow: Follow,
    rng: Rng,
    stage: Stage,
    watermark: u64,
    index: KeyIndex,
    mark: Mark,
    out: VecDeque<Output<D::Value>>,
    counters: Counters,
    next_token: u64,
    feed: Option<FeedState>,
    request: Option<(Token, Pending)>,
    timers: Timers,
    held: VecDeque<Held>,
    /// A wake came while a read of the source was underway: read again after it.
    rewake: bool,
    last_checkpoint: Option<u64>,
    opened_once: bool,
    backoffs: Backoffs,
    /// The highest watermark the source itself reported (a reconcile, a snapshot).
    known_source: u64,
    /// Announcements applied above the watermark, not yet confirmed by the source: key →
    /// what it claimed. The next read of the source that covers the seq, or that was asked
    /// for after it was applied, confirms or replaces them.
    ahead: std::collections::BTreeMap<String, confirm::Claim>,
    /// `ahead` as the sink last committed it: a failed batch gives back the claims its
    /// reads took (the sink still holds what they claimed).
    committed_ahead: std::collections::BTreeMap<String, confirm::Claim>,
    /// The driver said what the sink committed ahead of its watermark
    /// ([`remember_ahead`](Self::remember_ahead)): seqs it learns later are no claims.
    ahead_told: bool,
    /// Reads of the source (reconciles, snapshots) asked for so far.
    reads: u64,
    /// `reads` when the read now outstanding was asked for.
    read_asked: u64,
    /// The time of the last input or timeout: when a value that expires was applied.
    now: Time,
    /// The prefixes every key it keeps begins with (none: every key).
    prefixes: Vec<KeyPrefix>,
    /// A resync whose snapshot parts are arriving: what it keeps of them.
    parts: Option<Box<parts::Parts>>,
    /// A snapshot whose puts are being decided as the driver takes them.
    switch: Option<Box<switch::Switch>>,
    /// The watermark of the last complete listing of the source's keys: a per-key feed
    /// whose first available seq is at most one past it needs no listing again.
    listed_at: Option<u64>,
    /// The open feed waits for a listing of the source's keys before its entries apply
    /// (a per-key feed opened past a moved first seq).
    list_before_feed: bool,
    /// What the follower knows of its source's history ([`Lineage`]).
    known: lineage::Known,
    /// What the read outstanding said of the source's history, reported before its
    /// result ([`Input::Lineage`]).
    read_lineage: Option<(Token, Lineage)>,
    /// A read proved another history: the next snapshot replaces the cache whatever
    /// seqs it held.
    other_history: bool,
    /// The source compacted past the watermark, taking the entry whose stamp would have
    /// told this history from a copy restored from a backup and written past it: the next
    /// snapshot puts again every entry the cache holds at the same seq (see
    /// [`unconfirmed_at_compaction`](Self::unconfirmed_at_compaction)).
    unconfirmed: bool,
}

impl<D: Decode> Follower<D> {
    /// A follower with an empty cache that replays its feed ([`Follow::Replay`]; see
    /// [`following`](Self::following)). Its first output asks the driver to look the
    /// source up.
    pub fn new(config: FollowerConfig, decoder: D) -> Self {
        Self::resume(config, decoder, 0, std::iter::empty())
    }

    /// A follower restarting warm from a persisted cache: its watermark and the key and
    /// seq of every entry it holds. It resumes from `watermark`+1 and catches up only the
    /// delta.
    pub fn resume(
        config: FollowerConfig,
        decoder: D,
        watermark: u64,
        keys: impl IntoIterator<Item = (String, u64)>,
    ) -> Self {
        let seed = config.seed_or_zero();
        let mut index = KeyIndex::new(seed);
        index
            .seqs
            .extend(keys.into_iter().map(|(k, s)| (k.into(), s)));
        let mut f = Follower {
            rng: Rng::new(seed),
            backoffs: Backoffs {
                lookup: Backoff::new(config.lookup_backoff),
                failure: Backoff::new(config.failure_backoff),
                end: Backoff::new(config.end_backoff),
                stale: Backoff::new(config.failure_backoff),
                checkpoint: Backoff::new(config.failure_backoff),
            },
            config,
            decoder,
            follow: Follow::Replay,
            stage: Stage::Starting,
            watermark,
            index,
            mark: Mark {
                watermark,
                ready: false,
                checkpoint: None,
                known: lineage::Known::default(),
            },
            out: VecDeque::new(),
            counters: Counters::default(),
            next_token: 0,
            feed: None,
            request: None,
            timers: Timers::default(),
            held: VecDeque::new(),
            rewake: false,
            listed_at: None,
            list_before_feed: false,
            last_checkpoint: None,
            opened_once: false,
            known_source: 0,
            ahead: std::collections::BTreeMap::new(),
            committed_ahead: std::collections::BTreeMap::new(),
            ahead_told: false,
            reads: 0,
            read_asked: 0,
            now: Time::ZERO,
            prefixes: Vec::new(),
            parts: None,
            switch: None,
            known: lineage::Known::default(),
            read_lineage: None,
            other_history: false,
            unconfirmed: false,
        };
        f.send(Pending::Lookup);
        f
    }

    /// A follower restarting warm from a cache of `held` keys at `watermark` whose seqs
    /// it is not told up front (loading a million of them would cost more than the
    /// delta). The driver must [`remember`](Self::remember) the cached seqs of the keys
    /// of every entry or change before reporting it, and every cached key (then
    /// [`index_complete`](Self::index_complete)) before reporting a snapshot;
    /// [`needs_keys`](Self::needs_keys) says whether it still must.
    pub fn resume_lazily(config: FollowerConfig, decoder: D, watermark: u64, held: usize) -> Self {
        let mut f = Self::new(config, decoder);
        f.start_from(watermark, held);
        f
    }

    /// Makes a follower that has not yet been told anything a lazy warm start (see
    /// [`resume_lazily`](Self::resume_lazily)): a driver that learns what its sink holds
    /// only once it runs. Ignored once the follower has left [`Phase::Starting`] or knows
    /// keys.
    pub fn start_from(&mut self, watermark: u64, held: usize) {
        self.finish_switch();
        if self.stage != Stage::Starting || self.watermark != 0 || self.index.len() != 0 {
            return;
        }
        self.watermark = watermark;
        self.mark.watermark = watermark;
        self.index.hold_unknown(held);
    }

    /// Sets how the follower follows its feed (default [`Follow::Replay`]). A driver
    /// takes it from its feed; once a feed opens, the follower follows what the feed
    /// declares ([`FeedInfo::follow`]) whatever it was told.
    #[must_use]
    pub fn following(mut self, follow: Follow) -> Self {
        self.follow = follow;
        self
    }

    /// Limits the follower to keys under `prefix` (a driver takes it from its source, a
    /// view over part of a bucket or registry). A key outside it never reaches the cache,
    /// whatever brings it (the feed, an announcement, a reconcile, a snapshot): it is
    /// counted in [`Counters::outside`] and passed, and the watermark still moves past it.
    /// Keys a warm start named ([`resume`](Self::resume)) that are outside it are removed
    /// first; a lazily resumed cache's are removed by the next resync. Given several
    /// prefixes, the follower keeps the keys under all of them.
    #[must_use]
    pub fn within(mut self, prefix: KeyPrefix) -> Self {
        let mut outside: Vec<(std::sync::Arc<str>, u64)> = self
            .index
            .seqs
            .iter()
            .filter(|(k, _)| !prefix.matches(k))
            .map(|(k, s)| (std::sync::Arc::clone(k), *s))
            .collect();
        outside.sort_unstable();
        for (key, seq) in outside {
            self.index.remove(&key);
            self.counters.outside += 1;
            self.out
                .push_back(Output::Apply(Apply::Remove { key, seq }));
        }
        self.prefixes.push(prefix);
        self
    }

    // ---- getters ----

    /// The applied watermark: every change up to this seq is reflected in the cache. The
    /// cache may hold some later values too (from a marker's fetch, or announcements,
    /// which move the watermark only through a reconcile); per-key seqs keep those from
    /// ever being replaced by older ones.
    #[must_use]
    pub fn watermark(&self) -> u64 {
        self.watermark
    }

    /// Whether the initial sync completed.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        matches!(self.stage, Stage::Live | Stage::Stopped { ready: true })
    }

    /// How the follower follows its feed.
    #[must_use]
    pub fn follow(&self) -> Follow {
        self.follow
    }

    /// Where the follower is.
    #[must_use]
    pub fn phase(&self) -> Phase {
        match self.stage {
            Stage::Stopped { .. } => Phase::Stopped,
            _ if self.timers.any() => Phase::BackingOff,
            _ if matches!(self.request, Some((_, Pending::Snapshot))) => Phase::Resyncing,
            Stage::Starting => Phase::Starting,
            Stage::Syncing => Phase::Syncing,
            Stage::Live => Phase::Live,
        }
    }

    /// What it has done so far.
    #[must_use]
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The seq of `key`'s value in the cache, if the follower knows the cache holds it.
    #[must_use]
    pub fn seq_of(&self, key: &str) -> Option<u64> {
        self.index.get(key)
    }

    /// Whether the follower knows `key`'s state in the cache (always, unless it was
    /// resumed lazily and not told yet).
    #[must_use]
    pub fn knows(&self, key: &str) -> bool {
        self.index.unknown == 0 || self.index.seqs.contains_key(key)
    }

    /// Whether cached keys remain that the follower was not told about
    /// ([`resume_lazily`](Self::resume_lazily)).
    #[must_use]
    pub fn needs_keys(&self) -> bool {
        self.index.unknown > 0
    }

    /// How many keys the cache holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// How many keys an initial sync into an empty cache has made room for in the
    /// follower's index so far, from the feed's pending counts
    /// ([`presize_for`](crate::presize_for), then [`presize_more`](crate::presize_more)
    /// each time that room fills); 0 when it made none. A driver tells a sink that keeps
    /// its keys in memory the same ([`len`](Self::len) is what it holds), so the two
    /// tables grow together.
    #[must_use]
    pub fn presized(&self) -> usize {
        self.index.presized
    }

    /// Whether the cache is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// The prefixes its keys begin with ([`within`](Self::within)); empty: every key.
    #[must_use]
    pub fn prefixes(&self) -> &[KeyPrefix] {
        &self.prefixes
    }

    /// Whether `key` is one the follower keeps (under every prefix it was given).
    #[must_use]
    pub fn keeps(&self, key: &str) -> bool {
        self.prefixes.iter().all(|p| p.matches(key))
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &FollowerConfig {
        &self.config
    }

    /// A snapshot for an operator.
    #[must_use]
    pub fn status(&self) -> Status {
        Status {
            name: self.config.name.clone(),
            phase: self.phase(),
            watermark: self.watermark,
            ready: self.is_ready(),
            keys: self.index.len(),
            counters: self.counters,
            seed: self.config.seed_or_zero(),
            lineage: self.lineage(),
        }
    }

    // ---- mutators ----

    /// Tells the follower the seqs at which its cache holds `keys` (a driver of a lazily
    /// resumed follower, before it reports entries or changes for them). A key it already
    /// knows keeps what it knows (its own applies since are newer than anything the sink
    /// can say, and a key a read set aside must stay so); the watermark does not move.
    pub fn remember(&mut self, keys: impl IntoIterator<Item = (String, u64)>) {
        self.finish_switch();
        self.parts_disturbed(None);
        for (key, seq) in keys {
            // Held past the watermark on an announcements stream: applied from an
            // announcement no read of the source has covered (before a restart, maybe):
            // unconfirmed until one does. Committed with the sink's batch: a failed batch
            // goes back to a commit that holds it. (Unless the driver said what the sink
            // holds ahead: then every such key was claimed at start or in this run, and a
            // claim a read already confirmed must not be made again.)
            // A key outside the prefix is no claim: no read of the source will name it.
            let ahead = (!self.ahead_told && self.holds_unconfirmed(seq) && self.keeps(&key))
                .then(|| key.clone());
            if self.index.learn(key, seq)
                && let Some(key) = ahead
            {
                self.claim_committed(&key, seq, confirm::Claimed::Unknown);
            }
        }
    }

    /// Tells a warm-started follower what its sink committed ahead of its watermark
    /// ([`Ahead`]): call it once, after [`resume`](Self::resume),
    /// [`resume_lazily`](Self::resume_lazily) or [`start_from`](Self::start_from) and
    /// before the first input. On an announcements stream each change is held unconfirmed
    /// again, as it was before the restart: the first read of the source confirms it (the
    /// same seq, operation and bytes) or replaces it with the source's answer, and a
    /// removal keeps an older announcement from bringing the key back meanwhile. On a
    /// replayed feed, the source's own history, only the seqs are learned. Either way the
    /// keys' seqs are known from then on, so a lazily resumed follower learns the keys
    /// held past its watermark here, without a listing of every key.
    ///
    /// Once told, the seqs [`remember`](Self::remember) gives later are taken as what the
    /// sink holds, not as claims. Without this, a lazily resumed follower checks only the
    /// keys held past the watermark that it is told with `remember`, and by their seq (a
    /// read's put at that seq is applied again), and a removal committed ahead leaves it
    /// nothing to check.
    ///
    /// A change to a key outside the follower's prefixes ([`within`](Self::within); a
    /// cache that an earlier, wider follower wrote) is passed and counted in
    /// [`Counters::outside`]: no read of the source names that key, so held as a claim it
    /// would send every read on to a snapshot. A lazily resumed cache's key outside the
    /// prefixes leaves at the next resync, as the others do.
    pub fn remember_ahead(&mut self, changes: impl IntoIterator<Item = Ahead>) {
        self.finish_switch();
        self.parts_disturbed(None);
        self.ahead_told = true;
        for change in changes {
            if !self.keeps(change.key()) {
                self.counters.outside += 1;
                continue;
            }
            match change {
                Ahead::Put { key, seq, value } => {
                    if self.index.learn(key.clone(), seq) && self.holds_unconfirmed(seq) {
                        self.claim_committed(&key, seq, confirm::Claimed::Put(value));
                    }
                }
                // A key the sink holds a value for was put after it (a sink's own lapse):
                // the value is what the cache holds.
                Ahead::Removed { key, seq }
                    if self.holds_unconfirmed(seq) && self.index.get(&key).is_none() =>
                {
                    self.index.learn_removed(&key, seq);
                    self.claim_committed(&key, seq, confirm::Claimed::Removed);
                }
                Ahead::Removed { .. } => {}
            }
        }
    }

    /// The driver told it every cached key: nothing is left unknown.
    pub fn index_complete(&mut self) {
        self.finish_switch();
        self.index.unknown = 0;
    }

    /// Records, from now on, what each batch changes, so that a failed batch can be
    /// undone ([`Input::SinkFailed`]). A driver whose sink cannot fail need not.
    pub fn track_commits(&mut self, on: bool) {
        self.finish_switch();
        self.index.track(on);
    }

    /// The sink committed everything applied so far: a later [`Input::SinkFailed`] goes
    /// back to this point, not before it.
    pub fn commit(&mut self) {
        self.finish_switch();
        self.index.commit();
        self.committed_ahead.clone_from(&self.ahead);
        self.mark = Mark {
            watermark: self.watermark,
            ready: self.is_ready(),
            checkpoint: self.last_checkpoint,
            known: self.known,
        };
    }

    // ---- poll_* ----

    /// The next decision, if any.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Output<D::Value>> {
        let out = self.out.pop_front();
        self.switch_on();
        // A resync onto a new history decides a change per key at once: room for 1M
        // outputs (72 MiB) would otherwise stay held, empty, for the follower's life.
        if out.is_none() && self.out.capacity() > MAX_HELD {
            self.out.shrink_to(MAX_HELD);
        }
        out
    }

    /// The next decision, left in place: a driver that carries out some kinds of output
    /// at once (applies, while it still holds more input) and leaves the rest for later
    /// looks before it takes, so that it never takes an output out of order.
    #[must_use]
    pub fn peek_output(&self) -> Option<&Output<D::Value>> {
        self.out.front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        self.next_timer().map(|(at, _)| at)
    }

    /// Why [`poll_timeout`](Self::poll_timeout) asks to be woken: the backoff its deadline
    /// ends. `None` when no timeout is pending. For a driver's logs and an operator's
    /// status.
    #[must_use]
    pub fn timeout_cause(&self) -> Option<Cause> {
        self.next_timer().map(|(_, cause)| cause)
    }

    fn next_timer(&self) -> Option<(Time, Cause)> {
        let expiry = self.index.next_expiry().map(|at| (at, Cause::Expiry));
        match (self.timers.next(), expiry) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    // ---- internals: requests, the feed, timers ----

    fn stopped(&self) -> bool {
        matches!(self.stage, Stage::Stopped { .. })
    }

    /// A request is outstanding or waits to be retried: feed items are held, and no
    /// other request is sent.
    fn busy(&self) -> bool {
        self.request.is_some() || self.timers.retry_pending()
    }

    fn token(&mut self) -> Token {
        self.next_token += 1;
        Token(self.next_token)
    }

    fn diag(&mut self, d: Diagnostic) {
        self.out.push_back(Output::Diagnostic(d));
    }

    fn request_out(&mut self, r: Request) {
        self.out.push_back(Output::Request(r));
    }

    fn notice(&mut self, n: Notice) {
        self.out.push_back(Output::Notice(n));
    }

    fn send(&mut self, request: Pending) {
        if matches!(request, Pending::Reconcile | Pending::Snapshot) {
            self.reads += 1;
            self.read_asked = self.reads;
            // This read is asked for after every announcement applied so far: it confirms
            // them all (see `judge_ahead`).
            self.timers.confirmed();
        }
        // A new request supersedes a snapshot read in parts: its parts are ignored now.
        self.parts = None;
        self.read_lineage = None;
        let token = self.token();
        let output = match &request {
            Pending::Lookup => Request::LookupSource { token },
            Pending::Reconcile => Request::Reconcile {
                token,
                since: self.watermark,
            },
            Pending::Snapshot => Request::Snapshot { token },
            Pending::Fetch { key, seq, .. } => Request::Fetch {
                token,
                key: key.clone(),
                seq: *seq,
            },
            Pending::ListKeys => Request::ListKeys { token },
        };
        self.request = Some((token, request));
        self.request_out(output);
    }

    /// Takes the outstanding request if `token` and `kind` match it; counts it ignored
    /// otherwise.
    fn take_request(&mut self, token: Token, kind: impl Fn(&Pending) -> bool) -> bool {
        if self
            .request
            .take_if(|(t, r)| *t == token && kind(r))
            .is_some()
        {
            true
        } else {
            self.counters.ignored += 1;
            false
        }
    }

    /// What follows a finished request: held feed items, a pending wake, then the feed.
    fn settle(&mut self) {
        if self.list_before_feed && !self.busy() && !self.stopped() {
            self.send(Pending::ListKeys);
            return;
        }
        while !self.busy()
            && !self.stopped()
            && let Some(item) = self.held.pop_front()
        {
            self.on_item(item);
        }
        if self.stopped() || self.busy() {
            return;
        }
        if self.rewake {
            self.rewake = false;
            self.send(Pending::Reconcile);
            return;
        }
        self.maybe_open_feed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::RawBytes;

    #[test]
    fn the_room_a_huge_decision_took_is_given_back_once_it_is_drained() {
        let config = FollowerConfig::builder("t")
            .build()
            .expect("a valid config");
        let mut f = Follower::new(config, RawBytes);
        while f.poll_output().is_some() {}
        for _ in 0..10 * MAX_HELD {
            f.out.push_back(Output::Notice(Notice::Stopped));
        }
        while f.poll_output().is_some() {}
        assert!(
            f.out.capacity() <= MAX_HELD,
            "{} outputs of room kept, empty",
            f.out.capacity()
        );
    }
}
