//! Recording work already done: a call retried within what its lease still has.

use std::future::Future;
use std::time::Duration;

use tidemark_core::BackoffPolicy;
use tokio::time::Instant;

use crate::error::{Error, Result};

/// Makes `call`, and while it fails retryably tries again after the core's quick-reopen
/// delays ([`BackoffPolicy::fast_reopen`], 50 ms doubling, unjittered), until `deadline`
/// (tokio's clock): the last delay is cut to end there, for a last try at the deadline.
/// `on_retry` hears each failure that is tried again and the delay before the next try.
/// Returns the first success, a failure that is not retryable, or the failure of a try
/// that ended at or past the deadline.
///
/// For calls that record what already happened (a job's ack, an outbox row's landed
/// legs), with a deadline within the lease: a blip does not make finished work run twice,
/// and no try starts after another owner may hold the lease.
pub(crate) async fn settle<T, F, Fut>(
    deadline: Instant,
    mut call: F,
    mut on_retry: impl FnMut(&Error, Duration),
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let policy = BackoffPolicy::fast_reopen();
    let mut attempt = 0;
    loop {
        match call().await {
            Err(e) if e.is_retryable() => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(e);
                }
                let delay = policy.base_delay(attempt).min(deadline - now);
                on_retry(&e, delay);
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}
