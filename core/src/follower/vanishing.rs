//! What a source drops without a message: values that age out (expiry on the caller's
//! clock) and keys whose last message was purged (the periodic listing of its keys).

use std::collections::HashSet;

use super::Follower;
use crate::decode::Decode;
use crate::follower::io::{Apply, Follow, Output};
use crate::time::Time;

impl<D: Decode> Follower<D> {
    /// Removes the values whose age limit passed at `now`, where the source drops them
    /// silently: a newer value of the key (or its removal) cancels its expiry.
    pub(super) fn expire(&mut self, now: Time) {
        for (key, seq) in self.index.take_expired(now) {
            if self.index.get(&key) == Some(seq) {
                self.index.remove(&key);
                self.parts_disturbed(Some(&key));
                self.counters.expired += 1;
                self.out
                    .push_back(Output::Apply(Apply::Remove { key, seq }));
            }
        }
    }

    /// A listing of the source's keys, its watermark read first: a cached key it does not
    /// list, at a seq the listing covers, is gone from the source.
    ///
    /// The removal is as of the listing's watermark, except on an events stream: there
    /// every change above the watermark is an announcement's claim, which a durable sink
    /// keeps to check after a crash ([`Ahead`](crate::Ahead)), and the watermark trails
    /// the listing's until the next reconcile; this removal is a read of the source, not a
    /// claim, so it carries no seq past the watermark unless the key's own value did.
    pub(super) fn on_keys(&mut self, keys: Vec<String>, source_watermark: u64) {
        self.listed_at = Some(
            self.listed_at
                .map_or(source_watermark, |w| w.max(source_watermark)),
        );
        let present: HashSet<&str> = keys.iter().map(String::as_str).collect();
        let mut gone: Vec<(std::sync::Arc<str>, u64)> = self
            .index
            .seqs
            .iter()
            .filter(|(k, seq)| **seq <= source_watermark && !present.contains(&**k as &str))
            .map(|(k, seq)| (std::sync::Arc::clone(k), *seq))
            .collect();
        drop(present);
        gone.sort_unstable();
        for (key, seq) in gone {
            self.index.remove(&key);
            self.counters.vanished += 1;
            let removal = if self.follow == Follow::Announcements {
                source_watermark.min(self.watermark).max(seq)
            } else {
                source_watermark.max(seq)
            };
            self.out
                .push_back(Output::Apply(Apply::Remove { key, seq: removal }));
        }
        self.schedule_presence_check();
        let owed = std::mem::take(&mut self.list_before_feed);
        self.settle();
        // A feed that waited for this listing may have nothing more to deliver.
        if owed
            && !self.busy()
            && let Some(head) = self.feed_head()
        {
            self.check_ready(head);
        }
    }

    /// Schedules the next listing of the source's keys, when the follower is configured
    /// to check and is live.
    pub(super) fn schedule_presence_check(&mut self) {
        if let Some(every) = self.config.presence_check
            && self.is_ready()
            && !self.stopped()
        {
            self.timers
                .presence_at(Some(self.now.saturating_add(every)));
        }
    }
}
