//! Carrying out what the core decided: feed items into the core, cache changes into the
//! sink, requests to the ports (their answers back into the core), batches committed,
//! diagnostics logged and counted, the status published.

use super::*;

impl<S, F, C, W, D, K> FollowerTask<S, F, C, W, D, K>
where
    S: Source,
    F: Feed,
    C: Cursors,
    W: WakeListener,
    D: Decode + Send,
    K: Sink<D::Value>,
{
    /// Takes the items the feed has ready (up to a turn's worth), tells a lazily resumed
    /// core what the sink holds for their keys, and hands them to the core.
    ///
    /// A turn ends with the sink's commit, always: a turn is the batch. During the initial
    /// sync a turn takes up to [`SYNC_FEED_BATCH`] ready items rather than [`FEED_BATCH`],
    /// so a durable sink commits a big batch at a time (one SQLite transaction per 256
    /// entries made a 1M-key cold start take 77 s) without ever keeping applied changes
    /// uncommitted across a turn: the sink is asked what it holds only between commits,
    /// and a rewind goes back to a commit that every earlier turn made.
    pub(super) async fn on_feed(
        &mut self,
        token: Token,
        first: Option<Result<FeedItem>>,
    ) -> Result<()> {
        let turn = if self.core.is_ready() {
            FEED_BATCH
        } else {
            SYNC_FEED_BATCH
        };
        let more = matches!(first, Some(Ok(_)));
        let mut items = vec![first];
        if more
            && let Some((t, s)) = &mut self.stream
            && *t == token
        {
            s.next_ready(turn - 1, &mut items);
        }
        if self.core.needs_keys() {
            let keys: Vec<String> = items
                .iter()
                .filter_map(|i| match i {
                    Some(Ok(FeedItem::Entry(e))) => Some(e.key.to_string()),
                    _ => None,
                })
                .collect();
            if let Err(e) = self.learn(keys).await {
                // The items are dropped with the feed; it redelivers them after the rewind.
                return self.sink_failed(e).await;
            }
        }
        for item in &items {
            match item {
                // A replayed feed's pending count says how much of the source follows.
                Some(Ok(FeedItem::Entry(e))) if F::FOLLOW == Follow::Replay => {
                    self.learn_head(e.seq.saturating_add(e.pending.unwrap_or(0)));
                }
                Some(Ok(FeedItem::Entry(e))) => self.learn_head(e.seq),
                Some(
                    Ok(FeedItem::Undecodable { seq: Some(seq), .. }) | Ok(FeedItem::Head(seq)),
                ) => {
                    self.learn_head(*seq);
                }
                _ => {}
            }
        }
        // The keys the sink holds: every turn ends with its commit.
        let held = self.core.len();
        let now = self.clock.now();
        for item in items {
            let room = self.core.presized();
            self.core.handle_input(feed_input(token, item), now);
            // During an initial sync the sink makes room for what the feed says is coming
            // as the core does for its index, before the entry's change reaches it.
            if self.core.presized() > room {
                self.sink.reserve(self.core.presized().saturating_sub(held));
            }
            // Each entry's apply goes to the sink while it is fresh, not queued behind a
            // whole turn's worth (16k outputs written and read back through memory).
            if !self.apply_now().await? {
                // The sink failed and the core went back to its last commit: the rest of
                // the turn's items are dropped with the feed, which redelivers them.
                return Ok(());
            }
        }
        Ok(())
    }

    /// Carries out the applies (and checkpoints) at the front of the core's decisions, in
    /// order, leaving anything else (a request, a notice) and all after it for
    /// [`perform`](Self::perform). `false` when the sink failed (and the core was taken
    /// back to the last commit).
    pub(super) async fn apply_now(&mut self) -> Result<bool> {
        while matches!(
            self.core.peek_output(),
            Some(Output::Apply(_) | Output::Request(Request::Checkpoint { .. }))
        ) {
            let applied = match self.core.poll_output() {
                Some(Output::Apply(apply)) => self.apply(apply).await?,
                Some(Output::Request(Request::Checkpoint { position })) => {
                    self.batch.checkpoint = Some(position);
                    true
                }
                _ => true,
            };
            if !applied {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Hands one change to the sink. `false` when it failed (the sink was rolled back and
    /// the core taken back to the last commit); an error that is not retryable ends the run.
    pub(super) async fn apply(&mut self, apply: Apply<D::Value>) -> Result<bool> {
        self.batch.dirty = true;
        let applied = match apply {
            Apply::Put { key, seq, value } => self.sink.put(key, seq, value).await,
            Apply::Remove { key, seq } => self.sink.remove(key, seq).await,
            Apply::Restamp { keys } => self.sink.restamp(keys).await,
        };
        match applied {
            Ok(()) => Ok(true),
            Err(e) => {
                self.sink_failed(e).await?;
                Ok(false)
            }
        }
    }

    /// Tells a lazily resumed core every key the sink holds (before a snapshot or a
    /// listing decides which keys the source no longer has).
    pub(super) async fn complete_index(&mut self) -> Result<()> {
        if self.core.needs_keys() {
            let seqs = self.sink.all_seqs().await?;
            self.core.remember(seqs);
            self.core.index_complete();
        }
        Ok(())
    }

    /// Tells a lazily resumed core the seqs the sink holds for `keys` it does not know.
    pub(super) async fn learn(&mut self, mut keys: Vec<String>) -> Result<()> {
        keys.retain(|k| !self.core.knows(k));
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return Ok(());
        }
        let seqs = self.sink.seqs_of(keys).await?;
        self.core.remember(seqs);
        Ok(())
    }

    /// The sink failed: discard what it had not committed, and take the core back to the
    /// last commit. A retryable failure is retried after the core's backoff; any other
    /// ends the run with it.
    pub(super) async fn sink_failed(&mut self, e: Error) -> Result<()> {
        self.sink.rollback().await;
        self.batch = Batch::default();
        self.stream = None;
        warn!(worker = %self.core.config().name(), source = %self.source_name, error = %e, watermark = self.committed, "sink failed; going back to its last commit");
        self.core.handle_input(
            Input::SinkFailed {
                error: e.to_string(),
            },
            self.clock.now(),
        );
        if e.is_retryable() { Ok(()) } else { Err(e) }
    }

    /// Carries out every decision the core has, then commits the batch.
    pub(super) async fn perform(&mut self, stop: &mut StopSignal) -> Result<()> {
        loop {
            self.perform_outputs(stop).await?;
            match self.end_batch().await {
                // A failed cursor save is reported to the core, which may say more.
                Ok(()) if self.core.peek_output().is_some() => {}
                Ok(()) => return Ok(()),
                // The rewind's own decisions (close the feed, back off) come next.
                Err(e) => self.sink_failed(e).await?,
            }
        }
    }

    /// Commits what was applied with the watermark, then lets the world see it: the
    /// status, readiness, a reconcile's answer, the durable cursor, in that order.
    pub(super) async fn end_batch(&mut self) -> Result<()> {
        let watermark = self.core.watermark();
        let lineage = self.core.lineage();
        let committing =
            self.batch.dirty || watermark != self.committed || lineage != self.committed_lineage;
        if committing {
            self.sink.commit(watermark, lineage).await?;
            self.committed = watermark;
            self.committed_lineage = lineage;
            self.batch.dirty = false;
        }
        // The mark moves even when nothing was written: readiness reached on an empty
        // source, or a checkpoint, is committed state too.
        self.core.commit();
        self.publish_status();
        if std::mem::take(&mut self.batch.ready) {
            info!(worker = %self.core.config().name(), source = %self.source_name, watermark, "ready");
            self.sink.ready(watermark);
            // A caller who asked for a reconcile during the initial sync is answered by it.
            self.answer(Reconciled {
                watermark,
                ..Reconciled::default()
            });
        }
        if let Some(caught_up) = self.batch.caught_up.take() {
            self.answer(caught_up.into());
        }
        // A save that failed is asked for again by the core, after its backoff or once
        // the path is back ([`Input::CheckpointFailed`]), unless a later one stands for it.
        if let Some(position) = self.batch.checkpoint.take()
            && let Some(name) = &self.cursor_name
        {
            // A reconnect while the save is out cuts it, as it does a request: its reply
            // may have gone with the old connection. Saves are monotone, so one that
            // landed anyway does no harm.
            let saved = match self
                .reconnects
                .listen_from_now()
                .unless_reconnected(self.cursors.save(name, position))
                .await
            {
                Some(saved) => saved.map(|_| ()),
                None => Err(Error::unavailable(
                    "cursor",
                    "the client reconnected while the save was out",
                )),
            };
            if let Err(e) = saved {
                // Fail-soft: the core asks for the save again.
                warn!(worker = %self.core.config().name(), source = %self.source_name, position, error = %e, "checkpoint failed; saving it again");
                let failed = Input::CheckpointFailed {
                    position,
                    error: e.to_string(),
                };
                self.core.handle_input(failed, self.clock.now());
            }
        }
        Ok(())
    }

    /// Carries out every decision the core has, in order, feeding results back.
    ///
    /// Before a request to a port (a lookup, an open, a reconcile, a snapshot, a fetch),
    /// which can wait long while a server is away, the batch so far is committed; a stop
    /// asked meanwhile abandons the request, so `stop_within` keeps its budget, and so
    /// does a reconnect, so the follower does not wait out a reply that is lost. Sink
    /// calls are never abandoned halfway, nor cursor saves by a stop (a reconnect cuts a
    /// save: see [`end_batch`](Self::end_batch)).
    pub(super) async fn perform_outputs(&mut self, stop: &mut StopSignal) -> Result<()> {
        while let Some(output) = self.core.poll_output() {
            let Some(request) = self.carry_out(output).await? else {
                continue;
            };
            if let Err(e) = self.end_batch().await {
                // The request is dropped with the rest of the batch.
                self.sink_failed(e).await?;
                continue;
            }
            let answer = match self.ask(request, stop).await? {
                Asked::Answer(input) => input,
                Asked::Resumed(failure) => {
                    self.core.handle_input(failure, self.clock.now());
                    if !self.reconnects.arrived(Instant::now()) {
                        continue;
                    }
                    Input::Resumed
                }
                // A stop abandoned it.
                Asked::Abandoned => Input::Stop,
                // The sink failed before the answer could be used: the core rewound.
                Asked::Dropped => continue,
            };
            self.hand(answer);
        }
        Ok(())
    }

    /// Hands the core an answer, with what the sink holds where it says
    /// ([`Sink::HOLDS_VALUES`]): a new history's snapshot then keeps no second copy of a
    /// value the sink holds.
    pub(super) fn hand(&mut self, input: Input) {
        hand(&mut self.core, &self.sink, input, self.clock.now());
    }

    /// Carries out an output that needs no port (a cache change, a checkpoint, a notice, a
    /// diagnostic, closing the feed); returns a request to a port, which the caller asks.
    pub(super) async fn carry_out(&mut self, output: Output<D::Value>) -> Result<Option<Request>> {
        match output {
            Output::Request(r) if r.token().is_some() => return Ok(Some(r)),
            Output::Request(Request::CloseFeed { token })
                if self.stream.as_ref().is_some_and(|(t, _)| *t == token) =>
            {
                self.stream = None;
            }
            Output::Request(Request::Checkpoint { position }) => {
                self.batch.checkpoint = Some(position);
            }
            Output::Apply(apply) => {
                self.apply(apply).await?;
            }
            Output::Notice(Notice::Ready { .. }) => self.batch.ready = true,
            Output::Notice(Notice::CaughtUp(c)) => {
                debug!(worker = %self.core.config().name(), source = %self.source_name, applied = c.applied, removed = c.removed, watermark = c.watermark, resynced = c.resynced, "caught up");
                self.batch.caught_up = Some(c);
            }
            Output::Diagnostic(d) => self.diagnose(d),
            _ => {}
        }
        Ok(None)
    }

    /// Asks a port what `request` wants and turns its answer into the core's input.
    ///
    /// A reconnect of the source's or feed's client while the request is out abandons
    /// it: it is answered as failed at once (its reply may have gone with the old
    /// connection), and the reconnect, which the task hears next, retries it. So does the
    /// path to the source coming back while the request is out, as probes beside one
    /// that takes long tell ([`Asking`](tidemark_core::Asking)): it was sent while the
    /// path was cut, and its reply may never come ([`Asked::Resumed`]).
    pub(super) async fn ask(&mut self, request: Request, stop: &mut StopSignal) -> Result<Asked> {
        let token = request.token();
        let opening = matches!(request, Request::OpenFeed { .. });
        let probed = self
            .prober
            .probing()
            .then(|| (Arc::clone(&self.source), Arc::clone(&self.feed)));
        let mut cut = Cut::new(stop, &self.reconnects, probed, self.clock);
        let asked = self.ask_port(request, &mut cut).await?;
        let (by_reconnect, by_resume) = (cut.by_reconnect, cut.by_resume);
        Ok(match (asked, token) {
            (Asked::Abandoned, Some(token)) if by_reconnect || by_resume => {
                let error = if by_reconnect {
                    debug!(worker = %self.core.config().name(), source = %self.source_name, "client reconnected while a request was out; abandoning it");
                    "the client reconnected while the request was out"
                } else {
                    debug!(worker = %self.core.config().name(), source = %self.source_name, "the source answers again while a request sent before is still out; abandoning it");
                    "the source answered again while the request, sent before, was still out"
                };
                let error = error.to_owned();
                let failure = match opening {
                    true => Input::FeedFailed { token, error },
                    false => Input::RequestFailed { token, error },
                };
                match by_reconnect {
                    true => Asked::Answer(failure),
                    false => Asked::Resumed(failure),
                }
            }
            (asked, _) => asked,
        })
    }

    /// [`ask`](Self::ask) without the answer to a cut request.
    async fn ask_port(&mut self, request: Request, cut: &mut Cut<'_, S, F>) -> Result<Asked> {
        let answer = match request {
            Request::LookupSource { token } => {
                cut.or_cut_single(self.source.watermark())
                    .await
                    .map(|found| match found {
                        Ok(head) => {
                            // Until a feed says how far it will deliver: a view over a
                            // prefix never reaches the whole source's last seq.
                            if self.source.key_prefix().is_none() {
                                self.head = head;
                            }
                            Input::SourceFound { token }
                        }
                        Err(e) => failed(token, &e),
                    })
            }
            Request::OpenFeed {
                token,
                from,
                after_position,
            } => match cut.or_cut_single(self.open(from, after_position)).await {
                None => None,
                Some(Ok(mut opened)) => {
                    // The feed is the source's own history: what the source says of it at
                    // the watermark, read after the feed opened (a restore in between is
                    // seen), unless the feed said it itself.
                    if opened.info.follow == Follow::Replay
                        && opened.info.lineage == tidemark_core::Lineage::default()
                    {
                        match cut
                            .or_cut_single(self.source.lineage_at(from.saturating_sub(1)))
                            .await
                        {
                            None => return Ok(Asked::Abandoned),
                            Some(Ok(lineage)) => opened.info.lineage = lineage,
                            Some(Err(e)) => {
                                return Ok(Asked::Answer(Input::FeedFailed {
                                    token,
                                    error: e.to_string(),
                                }));
                            }
                        }
                    }
                    debug!(worker = %self.core.config().name(), source = %self.source_name, from, head = opened.info.head, "feed opened");
                    // The head the core becomes ready at: exactly what it can reach (a
                    // sparse or filtered feed's last seq may be a message that is gone,
                    // or another prefix's).
                    if opened.info.follow == Follow::Replay {
                        self.head = opened.info.head;
                    }
                    self.stream = Some((token, opened.stream));
                    Some(Input::FeedOpened {
                        token,
                        info: opened.info,
                    })
                }
                Some(Err(e)) => Some(Input::FeedFailed {
                    token,
                    error: e.to_string(),
                }),
            },
            Request::Reconcile { token, since } => return self.reconcile(token, since, cut).await,
            Request::Snapshot { token } => {
                // The resync judges every cached key: a lazily resumed core must know
                // them all before the first part.
                if let Err(e) = self.complete_index().await {
                    self.sink_failed(e).await?;
                    return Ok(Asked::Dropped);
                }
                self.read_snapshot(token, cut).await
            }
            Request::ListKeys { token } => return self.list_keys(token, cut).await,
            Request::Fetch { token, key, .. } => {
                match cut.or_cut_single(self.source.get_at(&key)).await {
                    None => None,
                    Some(Ok(read)) => {
                        if let Err(e) = self.learn(vec![key]).await {
                            self.sink_failed(e).await?;
                            return Ok(Asked::Dropped);
                        }
                        Some(Input::Fetched {
                            token,
                            value: read.value.map(|v| (v.seq, v.value)),
                            source_watermark: Some(read.watermark),
                        })
                    }
                    Some(Err(e)) => Some(failed(token, &e)),
                }
            }
            _ => return Ok(Asked::Dropped),
        };
        Ok(answer.map_or(Asked::Abandoned, Asked::Answer))
    }

    /// A reconcile: the changes since `since`, the keys they touch made known first.
    pub(super) async fn reconcile(
        &mut self,
        token: Token,
        since: u64,
        cut: &mut Cut<'_, S, F>,
    ) -> Result<Asked> {
        let (changes, lineage) = match cut.or_cut(self.source.changes_and_lineage(since)).await {
            None => return Ok(Asked::Abandoned),
            Some(Ok(read)) => read,
            Some(Err(e)) => return Ok(Asked::Answer(failed(token, &e))),
        };
        // What the source says of its history at `since`, read with the changes or after
        // them: a restore between the two reads is seen.
        self.core
            .handle_input(Input::Lineage { token, lineage }, self.clock.now());
        let answer = match changes {
            Changes::Since { entries, watermark } => {
                self.learn_head(watermark);
                let keys = entries.iter().map(|e| e.key.to_string()).collect();
                if let Err(e) = self.learn(keys).await {
                    self.sink_failed(e).await?;
                    return Ok(Asked::Dropped);
                }
                Input::Changes {
                    token,
                    changes: entries,
                    source_watermark: watermark,
                }
            }
            Changes::Compacted { first_available } => Input::ChangesUnavailable {
                token,
                first_available,
            },
        };
        Ok(Asked::Answer(answer))
    }

    /// A listing of the source's keys; the core must know every cached key first.
    pub(super) async fn list_keys(
        &mut self,
        token: Token,
        cut: &mut Cut<'_, S, F>,
    ) -> Result<Asked> {
        let answer = match cut.or_cut(self.source.present_keys()).await {
            None => return Ok(Asked::Abandoned),
            Some(Ok(Some(present))) => {
                // What the source says of its history at the watermark, read after the
                // listing: a bucket made again before the listing read it is seen, and
                // the listing, of another history, drops nothing.
                let at = self.core.watermark();
                let lineage = match cut.or_cut_single(self.source.lineage_at(at)).await {
                    None => return Ok(Asked::Abandoned),
                    Some(Ok(lineage)) => lineage,
                    Some(Err(e)) => return Ok(Asked::Answer(failed(token, &e))),
                };
                self.core
                    .handle_input(Input::Lineage { token, lineage }, self.clock.now());
                // The listing judges every cached key: a lazily resumed core must know
                // them all first.
                if let Err(e) = self.complete_index().await {
                    self.sink_failed(e).await?;
                    return Ok(Asked::Dropped);
                }
                Input::Keys {
                    token,
                    keys: present.keys,
                    source_watermark: present.watermark,
                }
            }
            Some(Ok(None)) => Input::RequestFailed {
                token,
                error: "this source cannot list its keys".into(),
            },
            Some(Err(e)) => failed(token, &e),
        };
        Ok(Asked::Answer(answer))
    }

    /// Reads the snapshot asked for under `token` part by part
    /// ([`Source::snapshot_parts`]), handing the core each part as it comes
    /// ([`Input::SnapshotPart`]) and the last as [`Input::Snapshot`], which is the answer
    /// returned (`None`: a stop or a reconnect came first). One part is held back so that the last can
    /// be told apart; a snapshot of one part is handed over whole. A part decides nothing,
    /// so nothing waits to be carried out between parts.
    pub(super) async fn read_snapshot(
        &mut self,
        token: Token,
        cut: &mut Cut<'_, S, F>,
    ) -> Option<Input> {
        let read = match cut
            .or_cut(self.source.snapshot_parts(self.snapshot_part_len))
            .await
        {
            None => return None,
            Some(Err(e)) => return Some(failed(token, &e)),
            Some(Ok(read)) => read,
        };
        // A snapshot reads the source whole: its head now, even a lower one.
        self.head = read.watermark;
        self.core.handle_input(
            Input::Lineage {
                token,
                lineage: read.lineage,
            },
            self.clock.now(),
        );
        let source_watermark = read.watermark;
        let mut parts = read.parts;
        let mut held: Vec<tidemark_core::Entry> = Vec::new();
        loop {
            let next = match cut.or_cut(parts.next()).await {
                None => return None,
                Some(None) => break,
                // The core drops what it kept and reads again after a backoff.
                Some(Some(Err(e))) => return Some(failed(token, &e)),
                Some(Some(Ok(next))) => next,
            };
            let entries = std::mem::replace(&mut held, next);
            if entries.is_empty() {
                continue;
            }
            let part = Input::SnapshotPart {
                token,
                entries,
                source_watermark,
            };
            hand(&mut self.core, &self.sink, part, self.clock.now());
        }
        Some(Input::Snapshot {
            token,
            entries: held,
            source_watermark,
        })
    }

    pub(super) async fn open(
        &mut self,
        from: u64,
        after: Option<u64>,
    ) -> Result<crate::ports::Opened<F::Stream>> {
        let saved = match (&self.cursor_name, self.cursor_loaded) {
            (None, _) => None,
            (Some(_), Some(saved)) => saved,
            (Some(name), None) => {
                let saved = self.cursors.load(name).await?;
                self.cursor_loaded = Some(saved);
                saved
            }
        };
        // The core knows only positions it checkpointed since it started; a restarted
        // consumer resumes after the durable cursor.
        let after = match (after, saved) {
            (Some(a), Some(s)) => Some(a.max(s)),
            (a, s) => a.or(s),
        };
        self.feed.open(from, after).await
    }

    /// Answers the callers of `reconcile()`, after the batch it covers was committed and
    /// the status published.
    pub(super) fn answer(&mut self, r: Reconciled) {
        for reply in self.pending.drain(..) {
            let _ = reply.send(r);
        }
    }

    pub(super) fn diagnose(&mut self, d: Diagnostic) {
        diagnose(self.core.config().name(), &self.source_name, d);
    }

    /// The source has reached at least `head`.
    pub(super) fn learn_head(&mut self, head: u64) {
        self.head = self.head.max(head);
    }

    pub(super) fn publish_status(&self) {
        let core = &self.core;
        self.status.send_if_modified(|s| {
            let before = (s.phase, s.ready, s.watermark, s.keys, s.counters, s.lineage);
            s.phase = core.phase();
            s.ready = core.is_ready();
            s.watermark = core.watermark();
            s.keys = core.len();
            s.counters = core.counters();
            s.lineage = core.lineage();
            // Watchers wake for any change, counters included: `wait_for(|s| s.counters
            // .poison > 0)` must not hang on a counter-only change.
            before != (s.phase, s.ready, s.watermark, s.keys, s.counters, s.lineage)
        });
        let status = self.status.borrow();
        self.progress.observe(&status, self.head, Instant::now());
        if let Some(m) = &self.metrics {
            m.record(&status, self.head);
        }
    }

    /// What the follower's health is judged from, shared with its handle.
    pub(crate) fn progress(&self) -> Arc<Progress> {
        Arc::clone(&self.progress)
    }
}

/// Logs what a follower's core reports. Not generic (one copy, whatever the follower's
/// types): it is the longest function of the task, and each follower kind instantiated it
/// anew (the simulator's build had 29 copies).
fn diagnose(worker: &str, source: &str, d: Diagnostic) {
    match d {
        Diagnostic::DecodeFailed { key, seq, error } => {
            warn!(
                worker,
                source, key, seq, error, "value failed to decode; skipped"
            );
        }
        Diagnostic::InvalidEntry { seq, key, reason } => {
            warn!(worker, source, key, seq, ?reason, "invalid entry skipped");
        }
        Diagnostic::Gap { expected, got } => {
            warn!(
                worker,
                source,
                expected,
                seq = got,
                "gap in a gapless feed; reconciling"
            );
        }
        Diagnostic::SeqRegressed { previous, got } => {
            debug!(
                worker,
                source,
                previous,
                seq = got,
                "feed seq went backwards"
            );
        }
        Diagnostic::Compacted {
            wanted,
            first_available,
        } => {
            warn!(
                worker,
                source, wanted, first_available, "history compacted; resyncing"
            );
        }
        Diagnostic::BackingOff {
            cause,
            attempt,
            delay,
            error,
        } => {
            warn!(
                worker,
                source,
                ?cause,
                attempt,
                ?delay,
                error,
                "backing off"
            );
        }
        Diagnostic::HeadBehind { head, watermark } => {
            warn!(
                worker,
                source, head, watermark, "feed head below the watermark; resyncing"
            );
        }
        Diagnostic::SourceReset {
            watermark,
            source_watermark,
        } => {
            warn!(
                worker,
                source,
                watermark,
                source_watermark,
                "the source is a new history (recreated or restored); cache replaced"
            );
        }
        Diagnostic::HistoryChanged {
            watermark,
            held,
            read,
        } => {
            warn!(
                worker,
                source,
                watermark,
                ?held,
                ?read,
                "the source serves another history than the one followed (recreated, or restored and written past the watermark); taking the new one"
            );
        }
        Diagnostic::FeedOfAnotherHistory {
            watermark,
            held,
            fed,
        } => {
            warn!(
                worker,
                source,
                watermark,
                held,
                fed,
                "the feed delivers another history than the cache holds; reopening it"
            );
        }
        Diagnostic::FollowChanged { from, to } => {
            warn!(
                worker,
                source,
                ?from,
                ?to,
                "the feed says how it must be followed; following it"
            );
        }
        Diagnostic::Rewound { watermark, error } => {
            warn!(
                worker,
                source, watermark, error, "went back to the sink's last commit"
            );
        }
        other => debug!(worker, source, ?other, "diagnostic"),
    }
}

/// Hands `core` an input (see [`FollowerTask::hand`]), borrowing only the core and the
/// sink (a snapshot's parts borrow the source meanwhile).
fn hand<D: Decode, K: Sink<D::Value>>(core: &mut Follower<D>, sink: &K, input: Input, now: Time) {
    if K::HOLDS_VALUES {
        core.handle_input_with(input, now, &Held(sink));
    } else {
        core.handle_input(input, now);
    }
}

/// A sink's committed values, as the core compares a new history's entries with them.
struct Held<'a, K>(&'a K);

impl<V, K: Sink<V>> tidemark_core::Cached<V> for Held<'_, K> {
    fn holds(&self, key: &str, new: &V, same: &dyn Fn(&V, &V) -> bool) -> bool {
        self.0.holds(key, new, same)
    }
}
