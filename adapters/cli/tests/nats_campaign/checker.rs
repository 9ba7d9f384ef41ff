//! What must hold, judged from what the followers showed and what the writers know landed
//! (the ledger): every value shown was written at the revision shown; never an older
//! value per key than one already shown; a key dropped only after a delete or purge; a
//! view at watermark W shows every key as the bucket held it at W unless the key's next
//! change was already sent when the view was read (a history-1 bucket may have replaced
//! the message at W before the follower read it); a follower's first ready view holds
//! every key present at its watermark; and, after the round heals, every follower equals
//! a fresh read of the bucket.
//!
//! A bucket recreated starts a new history (an epoch, named by every put's token) whose
//! revisions start at 1 again: a value is judged in its own history, "older" compares
//! (history, revision), so a value of an old history after one of a newer is older
//! whatever its revision, and a key of an old history may go when the follower takes the
//! new one. A follower that replays the bucket (the cache over it, the mirror) holds one
//! history at a time: a view with values of two, or of an older history than one it
//! showed before, served the old history after reading the new one (SPEC §4, one history).
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crate::ledger::{Kind, Ledger, epoch_of};

/// One entry as a follower showed it: key, revision, the value's token.
pub type Shown = (String, u64, String);

/// A revision in its history: (epoch, revision), ordered as "newer".
type Stamp = (u32, u64);

/// The history a value shown is of, from its token (0 for a token no writer made, which
/// the ledger then fails to find).
fn epoch(token: &str) -> u32 {
    epoch_of(token).unwrap_or(0)
}

/// The one history every entry is of; `None` for no entries or values of several.
fn one_epoch(entries: &[Shown]) -> Option<u32> {
    let mut epochs = entries.iter().map(|(_, _, t)| epoch(t));
    let first = epochs.next()?;
    epochs.all(|e| e == first).then_some(first)
}

/// A key's drop or return, judged against the ledger once it is complete.
#[derive(Debug)]
enum Flip {
    /// Shown at `after`, then not at all.
    Vanished { key: String, after: Stamp },
    /// Shown at `before`, dropped, then shown at `at`.
    Back {
        key: String,
        before: Stamp,
        at: Stamp,
    },
}

/// A view read whole at one watermark, and when the read ended.
#[derive(Debug)]
struct View {
    /// The history its values are of (`None`: it held none, or values of several).
    epoch: Option<u32>,
    watermark: u64,
    read: Instant,
    held: HashMap<String, u64>,
}

/// What one follower (one start of the cache, or the mirror's file across its restarts)
/// showed, sample after sample.
#[derive(Debug)]
pub struct Watcher {
    pub name: String,
    /// It replays the bucket: one history at a time.
    one_history: bool,
    /// Each sample is a whole view, taken between batches (a cache's snapshot, a file's
    /// read); not so for a worker's handlers, sampled between any two calls.
    whole_views: bool,
    last: HashMap<String, (Stamp, bool)>,
    shown: BTreeSet<Shown>,
    flips: Vec<Flip>,
    views: Vec<View>,
    /// The newest history it showed a value of, and its watermark in that history.
    watermark: Stamp,
    newest: u32,
    /// The entries of the last sample, and when a sample last showed other entries than
    /// the one before it: what the follower holds since then.
    previous: Vec<Shown>,
    changed: Option<Instant>,
    pub samples: u64,
    /// Values older than one shown before (or drops and returns) of a follower of
    /// announcements once it showed two histories: counted, not judged.
    pub old_after_new: u64,
    /// How often the history of the values it showed changed (the first counts), and the
    /// last one's.
    histories_seen: u32,
    seen_epoch: Option<u32>,
    /// The history the follower's last commit said it follows (its sink's lineage), and
    /// its epoch where the round knows it.
    followed: Option<u64>,
    followed_epoch: Option<u32>,
    /// Broken at once (an older value, a watermark that went back); the rest waits for
    /// the ledger.
    pub violations: Vec<String>,
}

impl Watcher {
    /// A watcher of `name`; `one_history` for a follower that replays the bucket.
    pub fn new(name: impl Into<String>, one_history: bool) -> Watcher {
        Watcher {
            name: name.into(),
            one_history,
            whole_views: true,
            last: HashMap::new(),
            shown: BTreeSet::new(),
            flips: Vec::new(),
            views: Vec::new(),
            watermark: (0, 0),
            newest: 0,
            previous: Vec::new(),
            changed: None,
            samples: 0,
            old_after_new: 0,
            histories_seen: 0,
            seen_epoch: None,
            followed: None,
            followed_epoch: None,
            violations: Vec::new(),
        }
    }

    /// A watcher of a worker's handlers (what its `on_put` and `on_delete` applied), which
    /// replay the bucket: judged per key as a follower that replays it (never older, a drop
    /// only after a removal or with an old history), but a sample may fall inside a batch,
    /// so one that holds values of two histories (a new history's snapshot half applied)
    /// is no violation.
    pub fn of_handlers(name: impl Into<String>) -> Watcher {
        Watcher {
            whole_views: false,
            ..Watcher::new(name, true)
        }
    }

    /// The history the follower's last commit said it follows (the lineage its sink was
    /// given), where the sampler knows it. A follower of announcements that takes a new
    /// history before it shows any of its values (a bucket made anew and still empty, or
    /// whose keys the follower has not fetched yet) has taken it all the same: an old
    /// announcement still in the events stream is then applied as new, and a key it
    /// dropped with the old history comes back at an older revision until the next read
    /// (seeds 20077, 20153). Its order is then counted, not judged, as once it has shown
    /// values of two histories. With `epoch` (which history that is), a value of an older
    /// history it shows is such an old announcement, even in a start that followed the
    /// new history from its first commit (seed 20127: a durable consumer's cold start
    /// whose cursor was among the old history's announcements).
    pub fn follows(&mut self, history: Option<u64>, epoch: Option<u32>) {
        let Some(history) = history else { return };
        if !self.one_history && self.followed.is_some_and(|was| was != history) {
            self.histories_seen = self.histories_seen.max(1) + 1;
        }
        self.followed = Some(history);
        self.followed_epoch = epoch;
    }

    /// A value of a history older than the one this follower of announcements follows:
    /// an old announcement applied as new, until the next read of the bucket.
    fn old_claim(&self, token: &str) -> bool {
        !self.one_history && self.followed_epoch.is_some_and(|e| epoch(token) < e)
    }

    /// One sample: every entry the follower holds; with `at`, the watermark they are
    /// exactly at (one read of the mirror's file; the cache's, read with its watermark
    /// unmoved around it) and when the read ended.
    pub fn observe(&mut self, at: Option<(u64, Instant)>, entries: &[Shown]) {
        self.samples += 1;
        if self.changed.is_none() || self.previous != entries {
            self.changed = Some(Instant::now());
            self.previous = entries.to_vec();
        }
        let watermark = at.map(|(w, _)| w);
        let view_epoch = one_epoch(entries);
        if self.one_history && self.whole_views {
            self.one_history_at_a_time(entries, view_epoch);
        }
        if let Some((w, read)) = at {
            let held = entries.iter().map(|(k, s, _)| (k.clone(), *s)).collect();
            self.views.push(View {
                epoch: view_epoch,
                watermark: w,
                read,
                held,
            });
            // A new history starts its revisions again: the watermark goes back with it.
            if let Some(e) = view_epoch {
                if (e, w) < self.watermark {
                    self.violations.push(format!(
                        "{}: committed watermark went back from {:?} to {w} in history {e}",
                        self.name, self.watermark
                    ));
                }
                self.watermark = self.watermark.max((e, w));
            }
        }
        let mut present = BTreeSet::new();
        for (_, _, token) in entries {
            let e = Some(epoch(token));
            if self.seen_epoch != e {
                self.histories_seen += 1;
                self.seen_epoch = e;
            }
        }
        for (key, seq, token) in entries {
            present.insert(key.as_str());
            if self.old_claim(token) {
                self.old_after_new += 1;
                continue;
            }
            if watermark.is_some_and(|w| *seq > w) {
                self.violations.push(format!(
                    "{}: {key} at {seq} committed above its watermark {watermark:?}",
                    self.name
                ));
            }
            let stamp = (epoch(token), *seq);
            match self.last.get(key) {
                // An announcement carries no history: one of the old history still in
                // the events stream when a follower of announcements took the new one
                // looks as new as any, and moves its watermark. Once such a follower has
                // shown two histories its order is counted, not judged (`old_after_new`);
                // convergence after the reconcile that follows healing still is.
                Some((prev, _)) if stamp < *prev && self.unordered() => {
                    self.old_after_new += 1;
                }
                Some((prev, _)) if stamp < *prev => self.violations.push(format!(
                    "{}: {key} went back from revision {} of history {} to {} of history {} \
                     (never-older)",
                    self.name, prev.1, prev.0, stamp.1, stamp.0
                )),
                Some((_, false)) if self.unordered() => self.old_after_new += 1,
                Some((prev, false)) => self.flips.push(Flip::Back {
                    key: key.clone(),
                    before: *prev,
                    at: stamp,
                }),
                _ => {}
            }
            self.shown.insert((key.clone(), *seq, token.clone()));
            self.last.insert(key.clone(), (stamp, true));
        }
        for (key, (seq, shown)) in &mut self.last {
            if *shown && !present.contains(key.as_str()) {
                *shown = false;
                if !self.one_history && self.histories_seen > 1 {
                    self.old_after_new += 1;
                    continue;
                }
                self.flips.push(Flip::Vanished {
                    key: key.clone(),
                    after: *seq,
                });
            }
        }
    }
}

impl Watcher {
    /// A follower of announcements that has shown two histories: its order is no longer
    /// judged (an announcement carries no history).
    fn unordered(&self) -> bool {
        !self.one_history && self.histories_seen > 1
    }

    /// A follower that replays the bucket never holds values of two histories at once,
    /// nor an older history's after it showed a newer one.
    fn one_history_at_a_time(&mut self, entries: &[Shown], view_epoch: Option<u32>) {
        let Some((_, _, token)) = entries.first() else {
            return;
        };
        let Some(e) = view_epoch else {
            let mut epochs: Vec<u32> = entries.iter().map(|(_, _, t)| epoch(t)).collect();
            epochs.sort_unstable();
            epochs.dedup();
            self.violations.push(format!(
                "{}: holds values of histories {epochs:?} at once (one is {token:?}): it \
                 served the old history's values beside the new one's (one history)",
                self.name
            ));
            return;
        };
        if e < self.newest {
            self.violations.push(format!(
                "{}: holds values of history {e} after it showed history {} (never-older, \
                 one history)",
                self.name, self.newest
            ));
        }
        self.newest = self.newest.max(e);
    }

    /// When the follower came to hold what it holds now (its entries unchanged in every
    /// sample since), if it was sampled at all.
    pub fn holding_since(&self) -> Option<Instant> {
        self.changed
    }
}

/// A follower's view at the moment it became ready.
#[derive(Debug, Clone)]
pub struct ReadyView {
    pub follower: String,
    pub watermark: u64,
    pub entries: Vec<Shown>,
}

/// How many checks passed.
#[derive(Debug, Default, Clone, Copy)]
pub struct Checks {
    /// Samples taken of the followers (each checked for never-older at once).
    pub samples: u64,
    /// Distinct (key, revision, value) a follower showed, each found in the ledger.
    pub values: u64,
    /// Drops and returns of a key, each matched to a delete or purge.
    pub flips: u64,
    /// Keys in views at a watermark found as the bucket held them there.
    pub current: u64,
    /// First ready views checked, and the keys they were checked for.
    pub ready_views: u64,
    pub ready_keys: u64,
    /// The bucket read after healing matched the ledger.
    pub ledger_matches: u64,
    /// Followers found equal to the bucket after healing.
    pub converged: u64,
    /// Followers that came to hold it within the liveness bound.
    pub live: u64,
    /// Durable consumers whose saved cursor reached the stream's last event.
    pub cursors: u64,
    /// Streams found within their configured limits after healing.
    pub storage: u64,
    /// Not a check passed: values of an old history a follower of announcements showed
    /// after the key's value in a newer one (announcements carry no history).
    pub old_after_new: u64,
    /// Jobs of the queue found acked (each after a handler run of it that succeeded) and
    /// found dead-lettered after healing; the handler runs.
    pub jobs_acked: u64,
    pub jobs_dead: u64,
    pub job_runs: u64,
    /// Not a check passed: jobs left leased with their message gone (see [`judge_jobs`]).
    pub jobs_unrecorded: u64,
    /// Outbox rows found in the relayed stream after healing; rows of claims checked
    /// against every other owner's; publishes found under their own relay's claim.
    pub relay_rows: u64,
    pub relay_claims: u64,
    pub relay_publishes: u64,
    /// Not checks: rows two relays published (under claims that did not overlap), rows in
    /// the stream more than once, and publishes begun after their claim's lease ran out
    /// while no other relay held the row.
    pub relay_republished: u64,
    pub relay_duplicates: u64,
    pub relay_late: u64,
}

impl Checks {
    pub fn add(&mut self, o: &Checks) {
        self.samples += o.samples;
        self.values += o.values;
        self.flips += o.flips;
        self.current += o.current;
        self.ready_views += o.ready_views;
        self.ready_keys += o.ready_keys;
        self.ledger_matches += o.ledger_matches;
        self.converged += o.converged;
        self.live += o.live;
        self.cursors += o.cursors;
        self.storage += o.storage;
        self.old_after_new += o.old_after_new;
        self.jobs_acked += o.jobs_acked;
        self.jobs_dead += o.jobs_dead;
        self.job_runs += o.job_runs;
        self.jobs_unrecorded += o.jobs_unrecorded;
        self.relay_rows += o.relay_rows;
        self.relay_claims += o.relay_claims;
        self.relay_publishes += o.relay_publishes;
        self.relay_republished += o.relay_republished;
        self.relay_duplicates += o.relay_duplicates;
        self.relay_late += o.relay_late;
    }
}

/// Judges what the watchers saw against the complete ledger; returns what broke.
pub fn judge(ledger: &Ledger, watcher: &Watcher, checks: &mut Checks) -> Vec<String> {
    let name = &watcher.name;
    let mut failures = watcher.violations.clone();
    checks.samples += watcher.samples;
    checks.old_after_new += watcher.old_after_new;
    for (key, seq, token) in &watcher.shown {
        let history = ledger.history(epoch(token));
        match history.and_then(|h| h.at(key, *seq)) {
            Some(Kind::Put(t)) if t == token => checks.values += 1,
            _ if history.is_some_and(|h| h.unplaced_at(key, token, *seq)) => {
                checks.values += 1;
            }
            found => failures.push(format!(
                "{name}: showed {key} = {token:?} at revision {seq}, but what landed there \
                 is {found:?}"
            )),
        }
    }
    // A key of a history the bucket no longer serves may go with it; within one history
    // a drop needs a removal.
    let removed = |key: &str, (e, after): Stamp, before: Option<u64>| {
        (e < ledger.last_epoch() && before.is_none())
            || ledger
                .history(e)
                .is_some_and(|h| h.removed_between(key, after, before))
    };
    for flip in &watcher.flips {
        match flip {
            Flip::Vanished { key, after } if !removed(key, *after, None) => failures.push(format!(
                "{name}: dropped {key} after showing revision {} of history {}, but no \
                     delete or purge of it landed after that",
                after.1, after.0
            )),
            Flip::Back { key, before, at }
                if at.0 == before.0 && !removed(key, *before, Some(at.1)) =>
            {
                failures.push(format!(
                    "{name}: showed {key} at {}, dropped it, then showed it at {} (history \
                     {}): every removal it could have shown is newer than {} (never-older)",
                    before.1, at.1, at.0, at.1
                ))
            }
            _ => checks.flips += 1,
        }
    }
    let mut stale = Vec::new();
    for view in &watcher.views {
        let w = view.watermark;
        // A view of no values is of no history the checker can name (it is judged by the
        // first ready view's check and by convergence); one of several broke already.
        let Some(history) = view.epoch.and_then(|e| ledger.history(e)) else {
            continue;
        };
        for key in history.keys() {
            // The bucket may have replaced the message at W before the follower read it
            // only if the key's next change was sent before the view was read.
            if history
                .next_sent_after(key, w)
                .is_some_and(|sent| sent < view.read)
                || history.unplaced_around(key, w)
            {
                continue;
            }
            let expected = history.state_at(key, w).map(|(seq, _)| seq);
            match view.held.get(key).copied() {
                got if got == expected => checks.current += 1,
                got => stale.push(format!(
                    "{name}: at watermark {w} of history {:?} showed {key} at {got:?}, but \
                     the bucket held it at {expected:?} then and its next change was sent \
                     after this view was read",
                    view.epoch
                )),
            }
        }
    }
    if stale.len() > 8 {
        let more = stale.len() - 8;
        stale.truncate(8);
        stale.push(format!(
            "{name}: and {more} more views out of date like these"
        ));
    }
    failures.extend(stale);
    failures
}

/// Judges a first ready view at watermark W: nothing above W; every key present at W is
/// held; a key not written after W (its message at W is still in the stream to read) is
/// held exactly as at W, or not at all if it was removed.
pub fn judge_ready(ledger: &Ledger, view: &ReadyView, checks: &mut Checks) -> Vec<String> {
    let (name, w) = (&view.follower, view.watermark);
    let mut failures = Vec::new();
    let held: HashMap<&str, u64> = view
        .entries
        .iter()
        .map(|(k, s, _)| (k.as_str(), *s))
        .collect();
    for (key, seq, _) in &view.entries {
        if *seq > w {
            failures.push(format!(
                "{name}: ready at {w} but holds {key} at {seq}, above it"
            ));
        }
    }
    // The history its values are of; a view of none is judged against the history that
    // held nothing at W, if one did.
    let epoch = match one_epoch(&view.entries) {
        Some(e) => e,
        None if view.entries.is_empty() => ledger
            .histories()
            .find(|(_, h)| h.keys().all(|k| h.state_at(k, w).is_none()))
            .map_or(ledger.last_epoch(), |(e, _)| e),
        None => {
            failures.push(format!(
                "{name}: ready at {w} with values of several histories (one history)"
            ));
            return failures;
        }
    };
    let Some(ledger) = ledger.history(epoch) else {
        failures.push(format!(
            "{name}: ready at {w} with values of history {epoch}, which was never made"
        ));
        return failures;
    };
    for key in ledger.keys() {
        let at_w = ledger.state_at(key, w);
        let settled = !ledger.changed_after(key, w);
        match (at_w, held.get(key.as_str())) {
            (Some((seq, _)), None) if !ledger.may_have_expired(key, seq) => failures.push(format!(
                "{name}: ready at {w} (history {epoch}) without {key}, which the bucket held \
                 at {seq} then (first ready view holds every key present at its head)"
            )),
            (Some((seq, _)), Some(got)) if settled && *got != seq => failures.push(format!(
                "{name}: ready at {w} with {key} at {got}, but the bucket held it at {seq} \
                 and never changed it after"
            )),
            (None, Some(got)) if settled => failures.push(format!(
                "{name}: ready at {w} with {key} at {got}, which was removed by then and \
                 never written again"
            )),
            _ => {}
        }
        checks.ready_keys += 1;
    }
    checks.ready_views += 1;
    failures
}

/// Where a job of the round's queue stands, read after healing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    /// Done: acked.
    Acked,
    DeadLettered,
    /// Leased, as its state says, and never finished; whether its message is still in
    /// the queue's stream (not: the server took its ack or its termination, and the
    /// state recording the job's end never followed).
    Leased {
        in_stream: bool,
    },
    /// Ready (again, or never leased): not run to its end.
    Waiting,
    /// Neither its message nor its state is in the queue.
    Lost,
}

/// One handler run of a job, as the handler ended it.
#[derive(Debug, Clone, Copy)]
pub struct JobRun {
    pub id: u64,
    pub ok: bool,
}

/// Every job of the queue (by id, with its kind) must end acked or dead-lettered once the
/// round healed: none lost, none left leased or waiting; and one acked had a handler run
/// that succeeded (an ack follows a success, at least once). Returns what broke, and apart
/// from it the jobs left leased whose message the server no longer holds: what the NATS
/// queue did when it settled a job's message before it recorded the job's end (a lost
/// confirmation or a crash between the two left the job leased forever; fixed, the end is
/// recorded first), told apart because its cause is known.
pub fn judge_jobs(
    ends: &BTreeMap<u64, (String, JobEnd)>,
    runs: &[JobRun],
    within: Duration,
    checks: &mut Checks,
) -> (Vec<String>, Vec<String>) {
    let succeeded: BTreeSet<u64> = runs.iter().filter(|r| r.ok).map(|r| r.id).collect();
    checks.job_runs += runs.len() as u64;
    let mut failures = Vec::new();
    let mut unrecorded = Vec::new();
    for (id, (kind, end)) in ends {
        match end {
            JobEnd::Acked if succeeded.contains(id) => checks.jobs_acked += 1,
            JobEnd::Acked => failures.push(format!(
                "job {id} ({kind}): acked, but no run of its handler succeeded"
            )),
            JobEnd::DeadLettered => checks.jobs_dead += 1,
            JobEnd::Leased { in_stream: true } => failures.push(format!(
                "job {id} ({kind}): its state still says leased {within:?} after healing, \
                 though no lease lasts that long, and its message is still in the queue's \
                 stream: left leased forever (every job ends acked or dead-lettered)"
            )),
            JobEnd::Leased { in_stream: false } => unrecorded.push(format!(
                "job {id} ({kind}): its message is gone from the queue's stream (the server \
                 took an ack or a termination of it) but its state still says leased, so no \
                 runner can lease it again: left leased forever, its end never recorded \
                 (every job ends acked or dead-lettered; NatsQueue settles the message \
                 before it records the end)"
            )),
            JobEnd::Waiting => failures.push(format!(
                "job {id} ({kind}): still waiting to run {within:?} after healing (every job \
                 ends acked or dead-lettered)"
            )),
            JobEnd::Lost => failures.push(format!(
                "job {id} ({kind}): neither its message nor its state is in the queue: lost"
            )),
        }
    }
    checks.jobs_unrecorded += unrecorded.len() as u64;
    (truncated(failures, "jobs"), truncated(unrecorded, "jobs"))
}

/// Keeps the first eight of `failures`, saying how many more of `what` there were.
fn truncated(mut failures: Vec<String>, what: &str) -> Vec<String> {
    if failures.len() > 8 {
        let more = failures.len() - 8;
        failures.truncate(8);
        failures.push(format!("{what}: and {more} more like these"));
    }
    failures
}

/// A claim a relay got: the registry seqs of its rows, when its relay asked and when the
/// claim came back (µs since the Unix epoch, the clock the outbox leases on), its lease.
#[derive(Debug, Clone)]
pub struct ClaimRec {
    pub owner: String,
    pub seqs: Vec<u64>,
    pub asked_us: u64,
    pub got_us: u64,
    pub lease_us: u64,
}

/// A relay's complete of rows (which releases its claims on the rows it still holds).
#[derive(Debug, Clone)]
pub struct ReleaseRec {
    pub owner: String,
    pub seqs: Vec<u64>,
    pub asked_us: u64,
}

/// A publish a relay began of the row of seq `seq`; whether the stream acknowledged it
/// (`None`: it never ended, its relay crashed).
#[derive(Debug, Clone)]
pub struct PublishRec {
    pub owner: String,
    pub seq: u64,
    pub at_us: u64,
    pub ok: Option<bool>,
}

/// What the relays did with the outbox, as their outbox and stream saw it.
#[derive(Debug, Default)]
pub struct RelayLog {
    pub claims: Vec<ClaimRec>,
    pub releases: Vec<ReleaseRec>,
    pub publishes: Vec<PublishRec>,
    /// Each outbox row's seq, by its id (what a complete names), from the claims.
    pub id_seq: HashMap<u64, u64>,
}

/// The outbox's clock counts whole milliseconds: a lease is taken as ending up to this
/// much before the relay's ask plus its length.
const LEASE_SLACK_US: u64 = 2_000;

/// When a relay surely held its claim on one row: from the claim's return until its lease
/// ran out (from its ask) or its relay asked to complete the row, whichever was first.
#[derive(Debug)]
struct Held<'a> {
    owner: &'a str,
    from: u64,
    until: u64,
    lease_end: u64,
}

impl RelayLog {
    /// Every claim on each row (by seq), as the window it surely held it.
    fn held(&self) -> BTreeMap<u64, Vec<Held<'_>>> {
        let mut released: HashMap<(&str, u64), Vec<u64>> = HashMap::new();
        for r in &self.releases {
            for seq in &r.seqs {
                released
                    .entry((r.owner.as_str(), *seq))
                    .or_default()
                    .push(r.asked_us);
            }
        }
        let mut out: BTreeMap<u64, Vec<Held<'_>>> = BTreeMap::new();
        for c in &self.claims {
            let lease_end = (c.asked_us + c.lease_us).saturating_sub(LEASE_SLACK_US);
            for seq in &c.seqs {
                let release = released
                    .get(&(c.owner.as_str(), *seq))
                    .and_then(|at| at.iter().filter(|at| **at >= c.got_us).min());
                out.entry(*seq).or_default().push(Held {
                    owner: &c.owner,
                    from: c.got_us,
                    until: release.map_or(lease_end, |r| (*r).min(lease_end)),
                    lease_end,
                });
            }
        }
        out
    }
}

/// Judges the relays: no row held by two owners' claims at once; every publish of a row
/// made by a relay holding its claim on it (claimed, not yet completed), never while
/// another relay held the row; once healed, no row pending and every row written (by
/// its seq) in the relayed stream, and nothing else there. A row published twice is
/// allowed (and counted) only so: under claims that did not overlap, the first run out.
pub fn judge_relays(
    log: &RelayLog,
    written: &BTreeSet<u64>,
    stream: &BTreeMap<u64, u64>,
    pending: u64,
    within: Duration,
    checks: &mut Checks,
) -> Vec<String> {
    let mut failures = Vec::new();
    let held = log.held();
    for (seq, claims) in &held {
        for (i, a) in claims.iter().enumerate() {
            checks.relay_claims += 1;
            for b in claims[i + 1..].iter().filter(|b| b.owner != a.owner) {
                let (from, until) = (a.from.max(b.from), a.until.min(b.until));
                if from < until {
                    failures.push(format!(
                        "relays: {} and {} both held a claim on the row of seq {seq}, for {} ms \
                         at once (claims of two owners overlapped)",
                        a.owner,
                        b.owner,
                        (until - from) / 1000
                    ));
                }
            }
        }
    }
    let mut owners: BTreeMap<u64, BTreeSet<&str>> = BTreeMap::new();
    for p in &log.publishes {
        owners.entry(p.seq).or_default().insert(&p.owner);
        let claims = held.get(&p.seq).map_or(&[][..], Vec::as_slice);
        let own = claims
            .iter()
            .filter(|h| h.owner == p.owner && h.from <= p.at_us)
            .max_by_key(|h| h.from);
        match own {
            None => failures.push(format!(
                "relays: {} published the row of seq {} without having claimed it",
                p.owner, p.seq
            )),
            Some(h) if h.until < p.at_us && h.until < h.lease_end => failures.push(format!(
                "relays: {} published the row of seq {} {} ms after it completed the row \
                 (its claim released) and before claiming it again",
                p.owner,
                p.seq,
                (p.at_us - h.until) / 1000
            )),
            Some(h) if p.at_us > h.lease_end => checks.relay_late += 1,
            Some(_) => checks.relay_publishes += 1,
        }
        let other = claims
            .iter()
            .find(|h| h.owner != p.owner && h.from <= p.at_us && p.at_us < h.until);
        if let Some(other) = other {
            failures.push(format!(
                "relays: {} began publishing the row of seq {} while {} held its claim",
                p.owner, p.seq, other.owner
            ));
        }
    }
    checks.relay_republished += owners.values().filter(|o| o.len() > 1).count() as u64;
    if pending > 0 {
        failures.push(format!(
            "relays: {pending} outbox row(s) still pending {within:?} after healing (every \
             row ends published)"
        ));
    }
    for seq in written {
        match stream.get(seq) {
            None => failures.push(format!(
                "relays: the row of seq {seq} is not in the relayed stream {within:?} after \
                 healing (every row ends published)"
            )),
            Some(n) => {
                checks.relay_rows += 1;
                checks.relay_duplicates += u64::from(*n > 1);
            }
        }
    }
    for seq in stream.keys().filter(|s| !written.contains(s)) {
        failures.push(format!(
            "relays: the relayed stream holds an event of seq {seq}, which no write of the \
             registry made"
        ));
    }
    truncated(failures, "relays")
}

/// How far past its `max_age` a stream's oldest message may be: the server removes aged
/// messages on a timer, not at the instant.
const AGE_SLACK: std::time::Duration = std::time::Duration::from_secs(10);

/// What a stream holds, as its info says: messages, bytes, subjects, and when its oldest
/// message was stored (nanoseconds since the Unix epoch).
#[derive(Clone, Copy, Debug)]
pub struct StreamHeld {
    pub messages: u64,
    pub bytes: u64,
    pub subjects: u64,
    pub first_ns: i128,
}

impl StreamHeld {
    pub fn of(state: &async_nats::jetstream::stream::State) -> StreamHeld {
        StreamHeld {
            messages: state.messages,
            bytes: state.bytes,
            subjects: state.subjects_count,
            first_ns: state.first_timestamp.unix_timestamp_nanos(),
        }
    }
}

/// What breaks a stream's configured limits, as its info says after healing (the time
/// now in nanoseconds since the Unix epoch): more messages or bytes than `max_messages`
/// and `max_bytes`, more messages than its per-subject limit allows for the subjects it
/// holds, an oldest message past its `max_age` (and a little slack).
pub fn stream_within_limits(
    config: &async_nats::jetstream::stream::Config,
    held: StreamHeld,
    now_ns: i128,
) -> Vec<String> {
    let name = &config.name;
    let mut failures = Vec::new();
    if let Ok(max) = u64::try_from(config.max_messages)
        && max > 0
        && held.messages > max
    {
        failures.push(format!(
            "storage: {name} holds {} messages, past its max_messages {max}",
            held.messages
        ));
    }
    if let Ok(max) = u64::try_from(config.max_bytes)
        && max > 0
        && held.bytes > max
    {
        failures.push(format!(
            "storage: {name} holds {} bytes, past its max_bytes {max}",
            held.bytes
        ));
    }
    if let Ok(per) = u64::try_from(config.max_messages_per_subject)
        && per > 0
        && held.messages > per.saturating_mul(held.subjects)
    {
        failures.push(format!(
            "storage: {name} holds {} messages on {} subjects, past {per} a subject",
            held.messages, held.subjects
        ));
    }
    if !config.max_age.is_zero() && held.messages > 0 {
        let age_ns = now_ns - held.first_ns;
        let age = std::time::Duration::from_nanos(u64::try_from(age_ns).unwrap_or(0));
        if age > config.max_age + AGE_SLACK {
            failures.push(format!(
                "storage: {name}'s oldest message is {age:?} old, past its max_age {:?}",
                config.max_age
            ));
        }
    }
    failures
}

/// The storage check, on made-up stream infos: within every limit passes; past each one
/// is reported.
fn self_check_storage() {
    let config = async_nats::jetstream::stream::Config {
        name: "S".into(),
        max_messages: 10,
        max_bytes: 1_000,
        max_messages_per_subject: 1,
        max_age: std::time::Duration::from_secs(60),
        ..Default::default()
    };
    let within = StreamHeld {
        messages: 3,
        bytes: 300,
        subjects: 3,
        first_ns: 0,
    };
    let at = |secs: i128| secs * 1_000_000_000;
    assert!(
        stream_within_limits(&config, within, at(30)).is_empty(),
        "a stream within its limits must pass"
    );
    let past = |held: StreamHeld, secs: i128, needle: &str| {
        let failures = stream_within_limits(&config, held, at(secs));
        assert!(
            failures.iter().any(|f| f.contains(needle)),
            "the storage check must report {needle:?}; it said {failures:?}"
        );
    };
    past(
        StreamHeld {
            messages: 11,
            subjects: 11,
            ..within
        },
        30,
        "max_messages",
    );
    past(
        StreamHeld {
            bytes: 1_001,
            ..within
        },
        30,
        "max_bytes",
    );
    past(
        StreamHeld {
            messages: 4,
            ..within
        },
        30,
        "a subject",
    );
    past(within, 71, "max_age");
}

/// The checker must catch what it is there to catch: judged on a small made-up history,
/// each kind of violation is reported and a correct run is not. Run before every
/// campaign (it takes microseconds), since a checker that cannot fail proves nothing.
pub fn self_check() {
    use crate::ledger::Landed;
    let (early, late) = (
        Instant::now(),
        Instant::now() + std::time::Duration::from_secs(60),
    );
    let mut ledger = Ledger::new(1);
    let history = [
        ("a", 1, Kind::Put("a#0.1".into()), early),
        ("b", 2, Kind::Put("b#0.1".into()), early),
        ("a", 3, Kind::Put("a#0.2".into()), early),
        ("a", 5, Kind::Delete, early),
        ("b", 6, Kind::Put("b#0.2".into()), late),
    ];
    for (key, seq, kind, sent) in history {
        let landed = Landed {
            epoch: 0,
            key: key.into(),
            seq,
            kind,
            sent,
        };
        ledger.record(&landed).unwrap_or_else(|e| panic!("{e}"));
    }
    let shown = |key: &str, seq: u64, token: &str| (key.to_owned(), seq, token.to_owned());
    let judged_in = |ledger: &Ledger, samples: &[(Option<u64>, Vec<Shown>)]| {
        let mut watcher = Watcher::new("made-up", true);
        for (at, entries) in samples {
            watcher.observe(at.map(|w| (w, early)), entries);
        }
        judge(ledger, &watcher, &mut Checks::default())
    };
    let judged = |samples: &[(Option<u64>, Vec<Shown>)]| judged_in(&ledger, samples);
    let expect = |what: &str, failures: Vec<String>, needle: &str| {
        assert!(
            failures.iter().any(|f| f.contains(needle)),
            "the checker must report {what} ({needle:?}); it said {failures:?}"
        );
    };

    let good = judged(&[
        (
            Some(2),
            vec![shown("a", 1, "a#0.1"), shown("b", 2, "b#0.1")],
        ),
        (
            Some(3),
            vec![shown("a", 3, "a#0.2"), shown("b", 2, "b#0.1")],
        ),
        (Some(5), vec![shown("b", 2, "b#0.1")]),
    ]);
    assert!(
        good.is_empty(),
        "a correct run must pass the checker: {good:?}"
    );
    let older = judged(&[
        (None, vec![shown("a", 3, "a#0.2")]),
        (None, vec![shown("a", 1, "a#0.1")]),
    ]);
    expect("an older value", older, "never-older");
    let invented = judged(&[(None, vec![shown("a", 3, "a#0.9")])]);
    expect("a value never written there", invented, "what landed there");
    let dropped = judged(&[(None, vec![shown("b", 2, "b#0.1")]), (None, vec![])]);
    expect(
        "a key dropped without a removal",
        dropped,
        "no delete or purge",
    );
    let stale = judged(&[(
        Some(5),
        vec![shown("a", 3, "a#0.2"), shown("b", 2, "b#0.1")],
    )]);
    expect(
        "a view behind a change it must hold",
        stale,
        "at watermark 5 of history Some(0) showed a",
    );
    let behind = judged(&[(Some(3), vec![shown("a", 3, "a#0.2")])]);
    expect(
        "a view without a key it must hold",
        behind,
        "at watermark 3 of history Some(0) showed b",
    );

    let view = |entries| ReadyView {
        follower: "made-up".into(),
        watermark: 3,
        entries,
    };
    let ready = view(vec![shown("a", 3, "a#0.2"), shown("b", 2, "b#0.1")]);
    let fine = judge_ready(&ledger, &ready, &mut Checks::default());
    assert!(fine.is_empty(), "a complete ready view must pass: {fine:?}");
    let lacking = judge_ready(
        &ledger,
        &view(vec![shown("b", 2, "b#0.1")]),
        &mut Checks::default(),
    );
    expect("a ready view without a present key", lacking, "without a");

    // Puts with a TTL: an expiry marker is a removal; a put whose revision is known only
    // within bounds passes only there and only with its own token; a TTL'd put whose
    // marker went unread (its bucket made again) may drop, one without may not.
    let ttl_ledger = |unread: bool| {
        let mut ledger = Ledger::new(1);
        for (key, seq, kind) in [
            ("c", 7, Kind::Put("c#0.1".into())),
            ("c", 9, Kind::Expired),
            ("d", 12, Kind::Expired),
            ("e", 13, Kind::Put("e#0.1".into())),
        ] {
            let landed = Landed {
                epoch: 0,
                key: key.into(),
                seq,
                kind,
                sent: early,
            };
            ledger.record(&landed).unwrap_or_else(|e| panic!("{e}"));
        }
        ledger.record_unplaced(&crate::ledger::Unplaced {
            epoch: 0,
            key: "d".into(),
            token: "d#0.1".into(),
            after: 10,
            before: 12,
        });
        if unread {
            ledger.record_expiry_unread(&crate::ledger::ExpiryUnread {
                epoch: 0,
                key: "e".into(),
                after: 13,
            });
        }
        ledger
    };
    let with_unread = ttl_ledger(true);
    let expired = judged_in(
        &with_unread,
        &[
            (None, vec![shown("c", 7, "c#0.1"), shown("d", 11, "d#0.1")]),
            (None, vec![shown("e", 13, "e#0.1")]),
            (None, vec![]),
        ],
    );
    assert!(
        expired.is_empty(),
        "an expiry, a put placed within its bounds and an unread expiry must pass: \
         {expired:?}"
    );
    let misplaced = judged_in(&with_unread, &[(None, vec![shown("d", 11, "d#0.9")])]);
    expect(
        "another value where an unplaced put may be",
        misplaced,
        "what landed there",
    );
    let outside = judged_in(&with_unread, &[(None, vec![shown("d", 12, "d#0.1")])]);
    expect(
        "an unplaced put outside its bounds",
        outside,
        "what landed there",
    );
    let unexplained = judged_in(
        &ttl_ledger(false),
        &[(None, vec![shown("e", 13, "e#0.1")]), (None, vec![])],
    );
    expect(
        "a TTL'd put dropped with its marker read and none landed",
        unexplained,
        "no delete or purge",
    );

    // The bucket deleted and made again: history 1 starts its revisions at 1 again.
    let mut remade = Ledger::new(2);
    for landed in [
        ("a", 1, Kind::Put("a#0.1".into()), 0),
        ("b", 2, Kind::Put("b#0.1".into()), 0),
        ("a", 3, Kind::Put("a#0.2".into()), 0),
        ("b", 1, Kind::Put("b#1.3".into()), 1),
    ] {
        let (key, seq, kind, epoch) = landed;
        remade
            .record(&Landed {
                epoch,
                key: key.into(),
                seq,
                kind,
                sent: early,
            })
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let taken = judged_in(
        &remade,
        &[
            (
                Some(3),
                vec![shown("a", 3, "a#0.2"), shown("b", 2, "b#0.1")],
            ),
            (Some(1), vec![shown("b", 1, "b#1.3")]),
        ],
    );
    assert!(
        taken.is_empty(),
        "taking the new history (its watermark and revisions lower, the old keys gone) \
         must pass: {taken:?}"
    );
    let mixed = judged_in(
        &remade,
        &[(None, vec![shown("a", 3, "a#0.2"), shown("b", 1, "b#1.3")])],
    );
    expect("the old history beside the new", mixed, "at once");
    let back = judged_in(
        &remade,
        &[
            (None, vec![shown("b", 1, "b#1.3")]),
            (None, vec![shown("a", 3, "a#0.2")]),
        ],
    );
    expect(
        "the old history after the new",
        back,
        "after it showed history 1",
    );
    let old_value = judged_in(
        &remade,
        &[
            (None, vec![shown("b", 1, "b#1.3")]),
            (None, vec![shown("b", 2, "b#0.1")]),
        ],
    );
    expect(
        "a key's old-history value after its new one",
        old_value,
        "never-older",
    );
    // A follower of announcements that took the new history while the bucket was still
    // empty, then applied an old announcement: counted, not judged; the same without the
    // new history taken is a drop and return no removal explains.
    let returned = |took: bool| {
        let mut watcher = Watcher::new("made-up", false);
        watcher.follows(Some(10), Some(0));
        watcher.observe(None, &[shown("a", 3, "a#0.2")]);
        if took {
            watcher.follows(Some(11), Some(1));
        }
        watcher.observe(None, &[]);
        watcher.observe(None, &[shown("a", 3, "a#0.2")]);
        let mut checks = Checks::default();
        (judge(&remade, &watcher, &mut checks), watcher.old_after_new)
    };
    let (failures, counted) = returned(true);
    assert!(
        failures.is_empty() && counted == 2, // the drop and the return
        "an old announcement after the new history was taken is counted, not judged: \
         {failures:?}, {counted}"
    );
    let (failures, _) = returned(false);
    expect("a drop and return in one history", failures, "dropped it");
    // A start that followed the new history from its first commit, showing an old
    // history's announcement, dropping it at the next read and showing another.
    let mut watcher = Watcher::new("made-up", false);
    watcher.follows(Some(11), Some(1));
    watcher.observe(None, &[shown("b", 1, "b#1.3"), shown("a", 3, "a#0.2")]);
    watcher.observe(None, &[shown("b", 1, "b#1.3")]);
    watcher.observe(None, &[shown("b", 1, "b#1.3"), shown("a", 1, "a#0.1")]);
    let failures = judge(&remade, &watcher, &mut Checks::default());
    assert!(
        failures.is_empty() && watcher.old_after_new == 2,
        "old announcements under the new history are counted, not judged: {failures:?}"
    );
    self_check_drivers(&remade, &expect);
    self_check_storage();
}

/// The drivers' checks, each fed a made-up history it must pass and ones it must report:
/// the worker's handlers sampled mid-batch, the jobs' ends, the relays' claims.
fn self_check_drivers(remade: &Ledger, expect: &dyn Fn(&str, Vec<String>, &str)) {
    let shown = |key: &str, seq: u64, token: &str| (key.to_owned(), seq, token.to_owned());
    // A new history's snapshot half applied by a worker's handlers is no violation; an
    // older value after a newer one still is.
    let mut worker = Watcher::of_handlers("made-up worker");
    worker.observe(None, &[shown("a", 3, "a#0.2"), shown("b", 2, "b#0.1")]);
    worker.observe(None, &[shown("a", 3, "a#0.2"), shown("b", 1, "b#1.3")]);
    worker.observe(None, &[shown("b", 1, "b#1.3")]);
    let failures = judge(remade, &worker, &mut Checks::default());
    assert!(
        failures.is_empty(),
        "a worker taking a new history key by key must pass: {failures:?}"
    );
    worker.observe(None, &[shown("b", 2, "b#0.1")]);
    let failures = judge(remade, &worker, &mut Checks::default());
    expect("a worker's older value", failures, "never-older");

    let within = Duration::from_secs(30);
    let ends = |list: &[(u64, JobEnd)]| -> BTreeMap<u64, (String, JobEnd)> {
        list.iter()
            .map(|(id, end)| (*id, ("made-up".to_owned(), *end)))
            .collect()
    };
    let runs = [JobRun { id: 1, ok: false }, JobRun { id: 1, ok: true }];
    let mut checks = Checks::default();
    let ended = ends(&[(1, JobEnd::Acked), (2, JobEnd::DeadLettered)]);
    let (fine, unrecorded) = judge_jobs(&ended, &runs, within, &mut checks);
    assert!(
        fine.is_empty() && unrecorded.is_empty() && checks.jobs_acked == 1 && checks.jobs_dead == 1,
        "jobs acked after a successful run or dead-lettered must pass: {fine:?}"
    );
    for (end, needle) in [
        (JobEnd::Leased { in_stream: true }, "left leased forever"),
        (JobEnd::Waiting, "still waiting"),
        (JobEnd::Lost, "lost"),
        (JobEnd::Acked, "no run of its handler succeeded"),
    ] {
        let ended = ends(&[(1, JobEnd::Acked), (3, end)]);
        let (failures, _) = judge_jobs(&ended, &runs, within, &mut Checks::default());
        expect(
            "a job that did not end acked or dead-lettered",
            failures,
            needle,
        );
    }
    let ended = ends(&[(1, JobEnd::Acked), (3, JobEnd::Leased { in_stream: false })]);
    let (_, unrecorded) = judge_jobs(&ended, &runs, within, &mut Checks::default());
    expect(
        "a job whose message the server dropped before its end was recorded",
        unrecorded,
        "its end never recorded",
    );

    let claim = |owner: &str, seqs: &[u64], asked_us: u64| ClaimRec {
        owner: owner.to_owned(),
        seqs: seqs.to_vec(),
        asked_us,
        got_us: asked_us + 10,
        lease_us: 1_000_000,
    };
    let release = |owner: &str, seqs: &[u64], asked_us: u64| ReleaseRec {
        owner: owner.to_owned(),
        seqs: seqs.to_vec(),
        asked_us,
    };
    let publish = |owner: &str, seq: u64, at_us: u64| PublishRec {
        owner: owner.to_owned(),
        seq,
        at_us,
        ok: Some(true),
    };
    let relayed = |claims: Vec<ClaimRec>,
                   releases: Vec<ReleaseRec>,
                   publishes: Vec<PublishRec>,
                   stream: &[(u64, u64)],
                   pending: u64| {
        let log = RelayLog {
            claims,
            releases,
            publishes,
            id_seq: HashMap::new(),
        };
        let mut checks = Checks::default();
        let stream = stream.iter().copied().collect();
        let written = BTreeSet::from([1, 2]);
        let failures = judge_relays(&log, &written, &stream, pending, within, &mut checks);
        (failures, checks)
    };
    // Relay a's publish of row 2 outlives its lease (it lands late); b claims the row once
    // the lease ran out and publishes it again: twice, under claims that did not overlap.
    let claims = || vec![claim("a", &[1, 2], 0), claim("b", &[2], 2_000_000)];
    let releases = || {
        vec![
            release("a", &[1, 2], 1_500_000),
            release("b", &[2], 2_000_100),
        ]
    };
    let publishes = || {
        vec![
            publish("a", 1, 20),
            publish("a", 2, 20),
            publish("b", 2, 2_000_020),
        ]
    };
    let (fine, checks) = relayed(claims(), releases(), publishes(), &[(1, 1), (2, 2)], 0);
    assert!(
        fine.is_empty() && checks.relay_republished == 1 && checks.relay_duplicates == 1,
        "a row published again after its first claim ran out must pass: {fine:?}"
    );
    let overlapping = vec![claim("a", &[1, 2], 0), claim("b", &[2], 400_000)];
    let mut early = publishes();
    early[2].at_us = 400_020;
    let (failures, _) = relayed(overlapping, releases(), early, &[(1, 1), (2, 2)], 0);
    expect(
        "claims of two owners at once",
        failures.clone(),
        "overlapped",
    );
    expect("a publish under another's claim", failures, "while a held");
    let mut unclaimed = publishes();
    unclaimed.push(publish("c", 1, 30));
    let (failures, _) = relayed(claims(), releases(), unclaimed, &[(1, 1), (2, 2)], 0);
    expect(
        "a publish without a claim",
        failures,
        "without having claimed",
    );
    let released = vec![
        release("a", &[1, 2], 500_000),
        release("b", &[2], 2_000_100),
    ];
    let mut after = publishes();
    after.push(publish("a", 1, 600_000));
    let (failures, _) = relayed(claims(), released, after, &[(1, 1), (2, 2)], 0);
    expect(
        "a publish after its row was completed",
        failures,
        "after it completed",
    );
    let (failures, _) = relayed(claims(), releases(), publishes(), &[(1, 1)], 0);
    expect(
        "a row missing from the stream",
        failures,
        "is not in the relayed",
    );
    let (failures, _) = relayed(
        claims(),
        releases(),
        publishes(),
        &[(1, 1), (2, 1), (3, 1)],
        1,
    );
    expect(
        "an event no write made",
        failures.clone(),
        "no write of the registry",
    );
    expect("a row left pending", failures, "still pending");
}
