//! What a supervisor does when a worker exits.

use crate::backoff::BackoffPolicy;

/// Whether a worker that exits is restarted in process.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum RestartPolicy {
    /// The first exit is terminal and reported to the supervisor (the default: a worker
    /// that fails should be seen, not silently looped).
    #[default]
    Never,
    /// Restart after a backoff, up to `max_restarts` times in a row (forever if `None`).
    OnExit {
        /// Delays between restarts.
        backoff: BackoffPolicy,
        /// How many restarts in a row before the exit becomes terminal.
        max_restarts: Option<u32>,
    },
}

impl RestartPolicy {
    /// Restarts forever with the default backoff.
    #[must_use]
    pub fn with_backoff() -> Self {
        RestartPolicy::OnExit {
            backoff: BackoffPolicy::default(),
            max_restarts: None,
        }
    }

    /// Whether a worker that has been restarted `restarts` times in a row may be again.
    #[must_use]
    pub fn allows_restart(&self, restarts: u32) -> bool {
        match self {
            RestartPolicy::Never => false,
            RestartPolicy::OnExit { max_restarts, .. } => max_restarts.is_none_or(|m| restarts < m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_first_exit_is_terminal() {
        assert_eq!(RestartPolicy::default(), RestartPolicy::Never);
        assert!(!RestartPolicy::default().allows_restart(0));
    }

    #[test]
    fn opt_in_restart_honours_its_limit() {
        let p = RestartPolicy::OnExit {
            backoff: BackoffPolicy::default(),
            max_restarts: Some(2),
        };
        assert!(p.allows_restart(0) && p.allows_restart(1));
        assert!(!p.allows_restart(2));
        assert!(RestartPolicy::with_backoff().allows_restart(u32::MAX - 1));
    }
}
