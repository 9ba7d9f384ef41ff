//! Deliberately naive follower strategies, which the oracle must catch diverging.

use tidemark::tidemark_core::{Continuity, FeedInfo};
use tidemark::{Feed, Opened, Result, Source};

use crate::remote::{Remote, RemoteStream};

/// "Watch new changes only": opens the change log at the source's current head, whatever
/// the follower has applied, and claims there is nothing to sync. The common KV watcher
/// that starts empty and loses everything written while it reconnects.
#[derive(Clone, Debug)]
pub struct NewOnlyFeed(pub Remote);

impl Feed for NewOnlyFeed {
    type Stream = RemoteStream;

    async fn open(&self, _from: u64, _after_position: Option<u64>) -> Result<Opened<RemoteStream>> {
        let head = self.0.watermark().await?;
        let opened = Feed::open(&self.0, head + 1, None).await?;
        Ok(Opened {
            info: FeedInfo {
                first_available: 0,
                head: 0,
                continuity: Continuity::Sparse,
                checkpoints: false,
            },
            stream: opened.stream,
        })
    }
}
