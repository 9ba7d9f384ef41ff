//! The Grafana dashboard and the Prometheus alert rules in `adapters/cli/ops/` name only series (and
//! labels) the code emits: a follower, a relay and a job runner run on the memory
//! adapter under a recorder, and every `tidemark_*` name and every label the files use
//! must be among what they registered. A renamed series fails here, not on a dashboard
//! that quietly goes blank.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tidemark::tidemark_core::{Job, Legs};
use tidemark::{
    Announcer, FollowerConfig, JobHandlers, JobRunner, Queue, Relay, Source, Utf8, spawn_cache,
};
use tidemark_memory::Memory;

/// Every series registered: name → its label names.
#[derive(Clone, Default)]
struct Names(Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>);

impl Names {
    fn note(&self, key: &Key) {
        let labels = key.labels().map(|l| l.key().to_owned());
        self.0
            .lock()
            .unwrap()
            .entry(key.name().to_owned())
            .or_default()
            .extend(labels);
    }

    fn get(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.0.lock().unwrap().clone()
    }
}

impl Recorder for Names {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.note(key);
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.note(key);
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.note(key);
        Histogram::noop()
    }
}

/// Runs one of each component that reports, and returns what they registered.
async fn emitted() -> BTreeMap<String, BTreeSet<String>> {
    let names = Names::default();
    let _guard = metrics::set_default_local_recorder(&names);
    let m = Memory::new();
    let source = m.announced_source(Legs::default());
    source.put("a", b"1".to_vec()).await.unwrap();
    let (cache, follower) = spawn_cache(
        FollowerConfig::new("f").unwrap(),
        Utf8,
        m.source.clone(),
        m.source.clone(),
    );
    cache.wait_ready().await.unwrap();
    let relay = Relay::new(
        m.outbox.clone(),
        Announcer::new(m.events.clone(), m.wake.clone(), m.queue.clone(), "changes"),
        "r",
    )
    .spawn();
    m.queue.enqueue(Job::Sweep).await.unwrap();
    let handlers = JobHandlers::new().on(["sweep", "pack_housekeeping"], |_: Job, _| async {
        Ok::<(), String>(())
    });
    let runner = JobRunner::new("j", m.queue.clone(), handlers)
        .idle_poll(Duration::from_millis(20))
        .spawn();
    let families = ["tidemark_follower_", "tidemark_outbox_", "tidemark_queue_"];
    let started = Instant::now();
    while !families
        .iter()
        .all(|f| names.get().keys().any(|n| n.starts_with(f)))
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "every component registers its series: {:?}",
            names.get()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    follower.stop_within(Duration::from_secs(5)).await.unwrap();
    relay.stop_within(Duration::from_secs(5)).await.unwrap();
    runner.stop_within(Duration::from_secs(5)).await.unwrap();
    names.get()
}

fn ops(file: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../adapters/cli/ops")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `tidemark_*` name in `text`.
fn series_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("tidemark_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        found.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    found
}

/// The label names `text` uses: in selectors (`{follower=~"…"}`), `by (…)` clauses,
/// alert templates (`$labels.follower`), legends (`{{follower}}`) and `label_values`.
fn labels_in(text: &str) -> BTreeSet<String> {
    let word = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = BTreeSet::new();
    for (open, close) in [("{{", "}}"), ("by (", ")"), ("label_values(", ")")] {
        for part in text.split(open).skip(1) {
            let inside = part.split(close).next().unwrap_or_default();
            let names: Vec<&str> = if open == "label_values(" {
                inside.split(',').skip(1).collect()
            } else {
                inside.split(',').collect()
            };
            found.extend(names.into_iter().map(word).filter(|w| !w.is_empty()));
        }
    }
    for part in text.split("$labels.").skip(1) {
        found.insert(word(part));
    }
    // Selectors: a series name, then `{label=…, label=~…}`.
    for part in text.split("tidemark_").skip(1) {
        let Some(sel) = part
            .trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '_')
            .strip_prefix('{')
        else {
            continue;
        };
        let sel = sel.split('}').next().unwrap_or_default();
        for m in sel.split(',') {
            found.insert(word(m));
        }
    }
    // Grafana's own: `{{ $value }}`-style templates are not labels.
    found.retain(|l| !matches!(l.as_str(), "" | "value" | "__all"));
    found
}

#[tokio::test]
async fn the_dashboard_and_the_alert_rules_name_only_series_the_code_emits() {
    let emitted = emitted().await;
    let labels: BTreeSet<String> = emitted.values().flatten().cloned().collect();

    let dashboard = ops("grafana-dashboard.json");
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    assert_eq!(
        parsed["uid"], "tidemark",
        "the dashboard is JSON Grafana imports"
    );
    let alerts = ops("prometheus-alerts.yml");
    for (file, text) in [
        ("grafana-dashboard.json", &dashboard),
        ("prometheus-alerts.yml", &alerts),
    ] {
        let named = series_in(text);
        assert!(
            named.len() >= 10,
            "{file} names the series it watches: {named:?}"
        );
        let unknown: Vec<&String> = named.iter().filter(|n| !emitted.contains_key(*n)).collect();
        assert!(
            unknown.is_empty(),
            "{file} names series no component emits: {unknown:?}; emitted: {:?}",
            emitted.keys()
        );
        let used = labels_in(text);
        let unknown: Vec<&String> = used.difference(&labels).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses labels no series carries: {unknown:?}; emitted: {labels:?}"
        );
    }
    // Every series the code emits is on the dashboard.
    let shown = series_in(&dashboard);
    let missing: Vec<&String> = emitted
        .keys()
        .filter(|n| n.starts_with("tidemark_") && !shown.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard shows every series: {missing:?}"
    );
    for alert in [
        "TidemarkFollowerLagGrowing",
        "TidemarkFollowerStalled",
        "TidemarkFollowerResyncs",
        "TidemarkDeadLetters",
        "TidemarkOutboxBacklog",
    ] {
        assert!(
            alerts.contains(&format!("alert: {alert}")),
            "{alert} is among the rules"
        );
    }
}

#[test]
fn the_scanners_find_what_they_look_for() {
    let text = r#"rate(tidemark_a_total{follower=~"$f", source="x"}[5m]) by (runner) {{relay}} $labels.node label_values(tidemark_b, kind) {{ $value }}"#;
    assert_eq!(
        series_in(text),
        ["tidemark_a_total", "tidemark_b"].map(String::from).into()
    );
    assert_eq!(
        labels_in(text),
        ["follower", "source", "runner", "relay", "node", "kind"]
            .map(String::from)
            .into()
    );
}
