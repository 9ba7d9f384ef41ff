//! Stand-ins for ports a driver is built without: no feed, no wake, no cursors.

use std::future::pending;

use crate::error::{Error, Result};
use crate::ports::{Cursors, Feed, FeedItem, FeedStream, Opened, Received, WakeListener};

/// No feed: a wake-only follower never opens one.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoFeed;

/// The stream of [`NoFeed`]: never yields.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoStream;

impl FeedStream for NoStream {
    async fn next(&mut self) -> Option<Result<FeedItem>> {
        pending().await
    }
}

impl Feed for NoFeed {
    const FOLLOW: tidemark_core::Follow = tidemark_core::Follow::WakeOnly;
    type Stream = NoStream;

    async fn open(&self, _from: u64, _after: Option<u64>) -> Result<Opened<NoStream>> {
        Err(Error::unavailable("feed", "this driver has no feed"))
    }
}

/// No wake listener: a feed follower is woken by its feed.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoWake;

impl WakeListener for NoWake {
    async fn recv(&mut self) -> Result<Received> {
        pending().await
    }
}

/// No durable cursors: the feed is addressed by seq.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoCursors;

impl Cursors for NoCursors {
    async fn load(&self, _name: &str) -> Result<Option<u64>> {
        Ok(None)
    }

    async fn save(&self, _name: &str, position: u64) -> Result<u64> {
        Ok(position)
    }
}
