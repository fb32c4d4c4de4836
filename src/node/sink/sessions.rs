//! The data-plane sessions of a node, one per peer endpoint, and the route
//! of one batch over them.

use super::*;

/// One slot per peer endpoint; its async lock makes concurrent first
/// transfers share one `open` instead of racing thousands of connections.
pub(super) type SessionSlot = Rc<futures::lock::Mutex<Option<Rc<AnySession>>>>;
pub(super) type Sessions = Rc<RefCell<HashMap<EndpointAddr, SessionSlot>>>;

/// Makes room for a session to `endpoint` under `max` sessions: closes the
/// idle ones (no transfer holds their slot) when full. Peers that restart
/// come back at new endpoints, so without this the map would only grow.
pub(super) fn make_room(
    sessions: &Sessions,
    endpoint: &EndpointAddr,
    max: usize,
) -> Result<(), MoveError> {
    let mut map = sessions.borrow_mut();
    if map.contains_key(endpoint) || map.len() < max {
        return Ok(());
    }
    map.retain(|_, slot| Rc::strong_count(slot) > 1);
    if map.len() < max {
        Ok(())
    } else {
        Err(MoveError::SessionsFull { busy: map.len() })
    }
}

/// Whether the session to `endpoint` copies through the peer's shared
/// memory now (a slot in use by a transfer counts as not).
pub(super) fn uses_shm(sessions: &Sessions, endpoint: &EndpointAddr) -> bool {
    let map = sessions.borrow();
    let Some(slot) = map.get(endpoint) else {
        return false;
    };
    let Some(guard) = slot.try_lock() else {
        return false;
    };
    matches!(guard.as_deref(), Some(AnySession::Tcp(s)) if s.uses_shm())
}

/// Where a data-plane batch goes.
pub(super) struct Route<'a> {
    pub(super) transport: &'a AnyTransport,
    pub(super) sessions: &'a Sessions,
    pub(super) endpoint: EndpointAddr,
}

impl Route<'_> {
    /// Moves every batch over one session, all batches in flight at once;
    /// at `deadline` (the machines' transfer bound counted from when the op
    /// was posted) the batches are dropped, which stops every socket
    /// operation on their memory at once. A `trailer` (writes only) goes to
    /// the peer's notification handler behind the bytes when the transport
    /// can make its delivery depend on all of them landing; `Ok(true)` says
    /// it was delivered, `Ok(false)` that the caller must deliver it.
    pub(super) async fn move_bytes(
        &self,
        op: Op,
        descs: &[Desc],
        batches: &[Range<usize>],
        trailer: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<bool, MoveError> {
        let slot = self
            .sessions
            .borrow_mut()
            .entry(self.endpoint)
            .or_default()
            .clone();
        let session = {
            let mut guard = slot.lock().await;
            match guard.as_ref() {
                Some(s) => s.clone(),
                None => {
                    let opened = self.transport.open(&self.endpoint).await;
                    let s = Rc::new(opened.map_err(MoveError::from)?);
                    *guard = Some(s.clone());
                    s
                }
            }
        };
        // The transport holds the batches' only timer, set to `deadline`:
        // its own batch bound (the same transfer bound, counted from this
        // call) would start after the op waited in its lane or for the
        // session, and a second timer here would only race it.
        let trailer = trailer.filter(|_| op == Op::Write && batches.len() == 1);
        let moves = batches
            .iter()
            .map(|b| session.transfer_until(op, &descs[b.clone()], trailer, deadline));
        let result = if self.transport.stops_on_drop() {
            futures::future::try_join_all(moves).await
        } else {
            // Dropping the others on the first failure would not stop
            // them, and this op's blocks would be released under them.
            let all = futures::future::join_all(moves).await;
            all.into_iter().collect::<Result<Vec<bool>, _>>()
        };
        let result = result
            .map(|delivered| delivered.contains(&true))
            .map_err(MoveError::from);
        if result.is_err() {
            // A broken session is re-opened by the next transfer.
            let mut guard = slot.lock().await;
            if guard.as_ref().is_some_and(|s| Rc::ptr_eq(s, &session)) {
                *guard = None;
            }
        }
        result
    }
}
