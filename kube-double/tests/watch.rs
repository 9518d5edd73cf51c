//! Watch semantics through kube's raw watch and `kube::runtime::watcher`.

use crate::common;

use std::time::Duration;

use common::*;
use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::ResourceExt;
use kube::api::{DeleteParams, Patch, PatchParams, WatchEvent, WatchParams};
use kube::runtime::watcher::{self, Event};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

async fn next<S, T>(stream: &mut S) -> T
where
    S: Stream<Item = T> + Unpin,
{
    tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("an item within the wait")
        .expect("the stream is still open")
}

/// A compact description of a watcher event, for exact comparisons.
fn describe(event: &Result<Event<Lease>, watcher::Error>) -> String {
    match event {
        Ok(Event::Init) => "Init".into(),
        Ok(Event::InitApply(l)) => format!("InitApply({})", l.name_any()),
        Ok(Event::InitDone) => "InitDone".into(),
        Ok(Event::Apply(l)) => format!("Apply({})", l.name_any()),
        Ok(Event::Delete(l)) => format!("Delete({})", l.name_any()),
        Err(watcher::Error::WatchError(status)) => format!("WatchError({})", status.code),
        Err(e) => format!("Err({e})"),
    }
}

async fn expect_events<S>(stream: &mut S, expected: &[&str])
where
    S: Stream<Item = Result<Event<Lease>, watcher::Error>> + Unpin,
{
    for want in expected {
        let got = describe(&next(stream).await);
        assert_eq!(got, *want);
    }
}

#[tokio::test]
async fn watcher_lists_then_follows() {
    let (double, client) = start().await;
    let api = leases(&client);
    create(&api, &lease("a", "x")).await;
    create(&api, &lease("b", "x")).await;

    let mut w = watcher::watcher(api.clone(), watcher::Config::default()).boxed();
    expect_events(
        &mut w,
        &["Init", "InitApply(a)", "InitApply(b)", "InitDone"],
    )
    .await;

    create(&api, &lease("c", "x")).await;
    expect_events(&mut w, &["Apply(c)"]).await;
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"holderIdentity": "y"}})),
    )
    .await
    .unwrap();
    expect_events(&mut w, &["Apply(a)"]).await;
    api.delete("b", &DeleteParams::default()).await.unwrap();
    expect_events(&mut w, &["Delete(b)"]).await;

    // Closing the watches: the watcher resumes from its last version
    // without listing again, and misses nothing written meanwhile.
    let lists = double.requests("list", "leases");
    let watches = double.requests("watch", "leases");
    double.close_watches();
    create(&api, &lease("d", "x")).await;
    expect_events(&mut w, &["Apply(d)"]).await;
    assert_eq!(double.requests("list", "leases"), lists);
    assert!(double.requests("watch", "leases") > watches);
}

#[tokio::test]
async fn watcher_relists_after_compaction() {
    let (double, client) = start().await;
    let api = leases(&client);
    create(&api, &lease("a", "x")).await;
    // Without bookmarks the watcher's version stays at its last event.
    let config = watcher::Config::default().disable_bookmarks();
    let mut w = watcher::watcher(api.clone(), config).boxed();
    expect_events(&mut w, &["Init", "InitApply(a)", "InitDone"]).await;

    // Another kind's write moves the global version past the watcher's.
    create(&pods(&client), &pod("p", json!({}), None)).await;
    double.compact();
    double.close_watches();
    expect_events(
        &mut w,
        &["WatchError(410)", "Init", "InitApply(a)", "InitDone"],
    )
    .await;
    create(&api, &lease("b", "x")).await;
    expect_events(&mut w, &["Apply(b)"]).await;
}

#[tokio::test]
async fn streaming_list_watcher_gets_initial_events() {
    let (_double, client) = start().await;
    let api = leases(&client);
    create(&api, &lease("a", "x")).await;
    let config = watcher::Config::default().streaming_lists();
    let mut w = watcher::watcher(api.clone(), config).boxed();
    expect_events(&mut w, &["Init", "InitApply(a)", "InitDone"]).await;
    create(&api, &lease("b", "x")).await;
    expect_events(&mut w, &["Apply(b)"]).await;
}

#[tokio::test]
async fn raw_watch_replays_and_expires() {
    let (double, client) = start().await;
    let api = leases(&client);
    let a = create(&api, &lease("a", "x")).await;
    let a_rv = a.resource_version().unwrap();
    create(&api, &lease("b", "x")).await;
    api.delete("a", &DeleteParams::default()).await.unwrap();

    // From "0": synthetic ADDED for what exists now.
    let mut from_zero = api
        .watch(&WatchParams::default().disable_bookmarks(), "0")
        .await
        .unwrap()
        .boxed();
    match next(&mut from_zero).await.unwrap() {
        WatchEvent::Added(l) => assert_eq!(l.name_any(), "b"),
        other => panic!("unexpected {other:?}"),
    }

    // From a version: every later event, in order.
    let mut replay = api
        .watch(&WatchParams::default().disable_bookmarks(), &a_rv)
        .await
        .unwrap()
        .boxed();
    match next(&mut replay).await.unwrap() {
        WatchEvent::Added(l) => assert_eq!(l.name_any(), "b"),
        other => panic!("unexpected {other:?}"),
    }
    match next(&mut replay).await.unwrap() {
        WatchEvent::Deleted(l) => {
            assert_eq!(l.name_any(), "a");
            assert!(l.resource_version().unwrap().parse::<u64>().unwrap() > a_rv.parse().unwrap());
        }
        other => panic!("unexpected {other:?}"),
    }

    double.compact();
    let mut expired = api
        .watch(&WatchParams::default().disable_bookmarks(), &a_rv)
        .await
        .unwrap()
        .boxed();
    match next(&mut expired).await.unwrap() {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        expired.next().await.is_none(),
        "the stream ends after the 410"
    );

    // Live events reach the open watch; closing ends it.
    create(&api, &lease("c", "x")).await;
    match next(&mut replay).await.unwrap() {
        WatchEvent::Added(l) => assert_eq!(l.name_any(), "c"),
        other => panic!("unexpected {other:?}"),
    }
    double.close_watches();
    let rest: Vec<_> = tokio::time::timeout(WAIT, replay.try_collect::<Vec<_>>())
        .await
        .unwrap()
        .unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn watch_selectors_timeout_and_bookmarks() {
    let (double, client) = start().await;
    let api = pods(&client);
    let params = WatchParams::default()
        .disable_bookmarks()
        .labels("app=web")
        .timeout(2);
    let mut w = api.watch(&params, "0").await.unwrap().boxed();
    create(&api, &pod("db", json!({"app": "db"}), None)).await;
    create(&api, &pod("web", json!({"app": "web"}), None)).await;
    match next(&mut w).await.unwrap() {
        WatchEvent::Added(p) => assert_eq!(p.name_any(), "web"),
        other => panic!("unexpected {other:?}"),
    }
    // timeoutSeconds ends the stream.
    let start = tokio::time::Instant::now();
    assert!(
        tokio::time::timeout(WAIT, w.next())
            .await
            .unwrap()
            .is_none()
    );
    assert!(start.elapsed() < Duration::from_secs(4));

    // Bookmarks carry the current version.
    let mut b = api
        .watch(
            &WatchParams::default(),
            &double.resource_version().to_string(),
        )
        .await
        .unwrap()
        .boxed();
    match next(&mut b).await.unwrap() {
        WatchEvent::Bookmark(bm) => {
            assert_eq!(
                bm.metadata.resource_version,
                double.resource_version().to_string()
            );
        }
        other => panic!("unexpected {other:?}"),
    }

    // An outage closes open watches.
    double.set_unavailable(true);
    assert!(
        tokio::time::timeout(WAIT, b.next())
            .await
            .unwrap()
            .is_none()
    );
    double.set_unavailable(false);

    // A failed watch request surfaces as an API error.
    double.fail_next("watch", "pods", 500, 1);
    let failed = api
        .watch(&WatchParams::default().disable_bookmarks(), "0")
        .await;
    assert_eq!(status_of(failed.map(|_| ())).code, 500);
}

#[tokio::test]
async fn finalizer_flow_events() {
    let (_double, client) = start().await;
    let api = sandboxes(&client);
    let pp = PatchParams::default();
    let created = create(
        &api,
        &sandbox(
            "s",
            json!({"metadata": {"finalizers": ["sandbolt.io/cleanup"]}}),
        ),
    )
    .await;
    let mut w = api
        .watch(
            &WatchParams::default().disable_bookmarks(),
            &created.resource_version().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    api.delete("s", &DeleteParams::default()).await.unwrap();
    match next(&mut w).await.unwrap() {
        WatchEvent::Modified(o) => assert!(o.metadata.deletion_timestamp.is_some()),
        other => panic!("unexpected {other:?}"),
    }
    api.patch(
        "s",
        &pp,
        &Patch::Merge(json!({"metadata": {"finalizers": []}})),
    )
    .await
    .unwrap();
    match next(&mut w).await.unwrap() {
        WatchEvent::Deleted(o) => {
            assert_eq!(o.name_any(), "s");
            assert!(o.finalizers().is_empty());
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(status_of(api.get("s").await).code, 404);
}
