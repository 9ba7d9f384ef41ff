//! What the command shows while it runs: log lines (`RUST_LOG`, on stderr) and, on a
//! terminal, a progress bar during the initial sync that log lines print above.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tidemark::Status;
use tracing::info;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// The bar on screen, if any: log lines are written around it.
#[derive(Clone, Default)]
pub struct Screen {
    bar: Arc<Mutex<Option<ProgressBar>>>,
}

impl Screen {
    fn bar(&self) -> Option<ProgressBar> {
        self.bar.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, bar: Option<ProgressBar>) {
        *self.bar.lock().unwrap_or_else(|e| e.into_inner()) = bar;
    }
}

/// Writes a log line to stderr, above the bar if one is drawn.
pub struct LineWriter {
    screen: Screen,
    buf: Vec<u8>,
}

impl Write for LineWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let buf = std::mem::take(&mut self.buf);
        let write = || {
            let mut err = std::io::stderr().lock();
            let _ = err.write_all(&buf);
            let _ = err.flush();
        };
        match self.screen.bar() {
            Some(bar) => bar.suspend(write),
            None => write(),
        }
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

impl<'a> MakeWriter<'a> for Screen {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter {
            screen: self.clone(),
            buf: Vec::new(),
        }
    }
}

/// Sends log lines to stderr, filtered by `RUST_LOG` (default: `info` for tidemark,
/// `warn` for everything else). Colours only on a terminal.
pub fn init_logging(screen: &Screen) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("warn,tidemark=info,tidemark_cli=info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(screen.clone())
        .init();
}

/// How often progress is logged when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(2);

/// Shows how far the initial sync is: a bar with revisions per second and an ETA on a
/// terminal, a log line every few seconds otherwise.
pub struct SyncProgress {
    screen: Screen,
    bar: Option<ProgressBar>,
    start: Option<u64>,
    logged: Instant,
    began: Instant,
}

impl SyncProgress {
    /// Starts showing progress (a bar when stderr is a terminal).
    pub fn new(screen: &Screen) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} syncing [{bar:40}] {pos}/{len} revisions, {per_sec}, ETA {eta} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        screen.set(bar.clone());
        SyncProgress {
            screen: screen.clone(),
            bar,
            start: None,
            logged: Instant::now(),
            began: Instant::now(),
        }
    }

    /// Takes in the follower's status and the source's head as it knows it.
    pub fn update(&mut self, s: &Status, head: u64) {
        if head == 0 {
            return;
        }
        // Counted from where this run started: a warm restart has only the delta to go.
        let start = *self.start.get_or_insert(s.watermark.min(head));
        let (done, total) = (
            s.watermark.saturating_sub(start),
            head.saturating_sub(start),
        );
        match &self.bar {
            Some(bar) => {
                bar.set_length(total);
                bar.set_position(done.min(total));
                bar.set_message(format!("({} keys)", s.keys));
            }
            None if self.logged.elapsed() >= LOG_EVERY => {
                self.logged = Instant::now();
                let secs = self.began.elapsed().as_secs_f64().max(0.001);
                #[allow(clippy::cast_precision_loss)]
                let rate = done as f64 / secs;
                info!(
                    watermark = s.watermark,
                    head,
                    keys = s.keys,
                    "syncing: {done} of {total} revisions ({rate:.0}/s)"
                );
            }
            None => {}
        }
    }

    /// The initial sync is over: the bar goes away.
    pub fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        self.screen.set(None);
    }
}
