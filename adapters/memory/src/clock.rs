//! The clock a memory port reads: tokio's, or one given in.

use std::sync::Arc;

use tokio::time::Instant;

/// Tokio's clock, or the one a caller gave (a simulator's, which outlives the runtimes of
/// the hosts that restart: each new runtime's `Instant`s start from a new base).
#[derive(Clone, Default)]
pub(crate) struct Now(Option<Arc<dyn Fn() -> Instant + Send + Sync>>);

impl Now {
    pub(crate) fn given(clock: impl Fn() -> Instant + Send + Sync + 'static) -> Self {
        Now(Some(Arc::new(clock)))
    }

    pub(crate) fn now(&self) -> Instant {
        self.0.as_ref().map_or_else(Instant::now, |clock| clock())
    }
}

impl std::fmt::Debug for Now {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "given" } else { "tokio" })
    }
}
