//! Deliberately naive follower strategies, which the oracle must catch diverging.

use tidemark::tidemark_core::{Continuity, FeedInfo, Follow};
use tidemark::{Feed, Opened, Result, Source};

use crate::remote::{Remote, RemoteEvents, RemoteStream};

/// "Watch new changes only": opens the change log at the source's current head, whatever
/// the follower has applied, and claims there is nothing to sync. The common KV watcher
/// that starts empty and loses everything written while it reconnects.
#[derive(Clone, Debug)]
pub struct NewOnlyFeed(pub Remote);

impl Feed for NewOnlyFeed {
    const FOLLOW: Follow = Follow::Replay;
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
                follow: Follow::Replay,
            },
            stream: opened.stream,
        })
    }
}

/// "No reconcile": an announcements stream that claims to be the source's own history, so
/// the follower replays it and never reads the source. Every announcement a writer lost
/// between commit and announce is lost for good.
#[derive(Clone, Debug)]
pub struct EventsAsReplay(pub RemoteEvents);

impl Feed for EventsAsReplay {
    const FOLLOW: Follow = Follow::Replay;
    type Stream = RemoteStream;

    async fn open(&self, from: u64, after_position: Option<u64>) -> Result<Opened<RemoteStream>> {
        let mut opened = Feed::open(&self.0, from, after_position).await?;
        opened.info.follow = Follow::Replay;
        Ok(opened)
    }
}
