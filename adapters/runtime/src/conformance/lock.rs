//! The `Lock` port: exclusive, expiring leases with fencing tokens.

use super::common::*;

/// An owner taking a lock it holds gets a new lease with a greater fencing token, and
/// the earlier lease is lost: it cannot be renewed, and releasing it leaves the new one
/// held. Two sweeps of one process under one owner name then never both hold the lock,
/// and the first to finish cannot free it while the other still runs.
pub async fn lock_taken_again_by_its_owner_is_a_new_lease<L: Lock>(l: &L) {
    const TTL: Duration = Duration::from_secs(60);
    let first = l
        .try_lock("sweeper", "a", TTL)
        .await
        .unwrap()
        .expect("a free lock");
    let second = l
        .try_lock("sweeper", "a", TTL)
        .await
        .unwrap()
        .expect("its owner takes it again");
    assert!(
        second.fencing > first.fencing,
        "a token grows with every acquisition: {} then {}",
        first.fencing,
        second.fencing
    );
    assert!(
        matches!(l.renew(&first, TTL).await, Err(crate::Error::LeaseLost(_))),
        "the earlier lease is lost"
    );
    l.release(&first).await.unwrap();
    assert!(
        l.try_lock("sweeper", "b", TTL).await.unwrap().is_none(),
        "releasing the earlier lease leaves the new one held"
    );
    l.renew(&second, TTL).await.unwrap();
    l.release(&second).await.unwrap();
    assert!(
        l.try_lock("sweeper", "b", TTL).await.unwrap().is_some(),
        "released: free"
    );
}

/// A lock taken for [`Duration::MAX`] is held for ever: never a panic on the instant it
/// would expire at (an overflow), and no other owner takes it; renewing it for ever again
/// and releasing it work.
pub async fn lock_for_ever_is_held<L: Lock>(l: &L) {
    let a = l
        .try_lock("sweeper", "a", Duration::MAX)
        .await
        .unwrap()
        .expect("a free lock");
    assert!(
        l.try_lock("sweeper", "b", Duration::from_secs(1))
            .await
            .unwrap()
            .is_none(),
        "held for ever: no other owner takes it"
    );
    l.renew(&a, Duration::MAX).await.unwrap();
    l.release(&a).await.unwrap();
    assert!(
        l.try_lock("sweeper", "b", Duration::from_secs(1))
            .await
            .unwrap()
            .is_some(),
        "released: free"
    );
}

/// One holder at a time; an expired lease frees the lock with a higher fencing token, and
/// the old holder can no longer renew.
///
/// `ttl` is the lease the test takes: short under paused time, long enough on a real clock
/// that the checks made while a lease is held finish inside it on a loaded machine.
pub async fn lock_is_exclusive_and_expires<L: Lock>(l: &L, ttl: Duration) {
    let a = l
        .try_lock("sweeper", "a", ttl)
        .await
        .unwrap()
        .expect("a free lock");
    assert!(
        l.try_lock("sweeper", "b", ttl).await.unwrap().is_none(),
        "exclusive while held"
    );
    l.renew(&a, ttl).await.unwrap();
    tokio::time::sleep(ttl * 3 / 2).await;
    let b = l
        .try_lock("sweeper", "b", ttl)
        .await
        .unwrap()
        .expect("expired: free again");
    assert!(b.fencing > a.fencing, "fencing tokens grow");
    assert!(
        l.renew(&a, ttl).await.is_err(),
        "the expired holder lost the lock"
    );
    l.release(&a).await.unwrap();
    assert!(
        l.try_lock("sweeper", "c", ttl).await.unwrap().is_none(),
        "a stale release is a no-op"
    );
    l.release(&b).await.unwrap();
    assert!(
        l.try_lock("sweeper", "c", ttl).await.unwrap().is_some(),
        "released: free"
    );
}

/// The sweeper lock's fencing token goes with the sweep, and the store refuses a token
/// older than the lock's current one: a sweeper stalled past its lease (a pause, a
/// partition), whose lock another process has taken since, must not sweep beside its
/// successor; nor may an owner's earlier lease once it took the lock again. The current
/// holder sweeps.
///
/// `s` must check its fences against `l`; `ttl` as for [`lock_is_exclusive_and_expires`].
pub async fn sweep_refuses_a_stale_fence<L: Lock, S: crate::ports::Sweep>(
    l: &L,
    s: &S,
    ttl: Duration,
) {
    let name = crate::retention::SWEEP_LOCK;
    let stalled = l
        .try_lock(name, "a", ttl)
        .await
        .unwrap()
        .expect("a free lock");
    tokio::time::sleep(ttl * 3 / 2).await;
    let successor = l
        .try_lock(name, "b", ttl)
        .await
        .unwrap()
        .expect("an expired lease frees the lock");
    let refused = s.sweep(&stalled).await;
    assert!(
        matches!(refused, Err(crate::Error::LeaseLost(_))),
        "a sweeper whose lock was taken since must not sweep beside its successor: {refused:?}"
    );
    s.sweep(&successor)
        .await
        .expect("the lock's current holder sweeps");
    let again = l
        .try_lock(name, "b", ttl)
        .await
        .unwrap()
        .expect("its owner takes it again");
    let refused = s.sweep(&successor).await;
    assert!(
        matches!(refused, Err(crate::Error::LeaseLost(_))),
        "an owner's earlier lease is fenced out by its own later one: {refused:?}"
    );
    s.sweep(&again).await.expect("the newest lease sweeps");
    l.release(&again).await.unwrap();
}
