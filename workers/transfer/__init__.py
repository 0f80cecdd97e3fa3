"""KV transfer: a request's KV blocks from a prefill worker's pool into blocks a decode worker reserved.

    base.py       the interface the roles call (KVSender, KVReceiver, Transfer) and what they get back
    registry.py   transport name -> workers/transfer/<name>.py; make_sender, make_receiver
    errors.py     TransferError, LayoutMismatch; IllegalMove (a bug: a move its ladder has no rung for)
    sender.py     the prefill side every transport shares: handshake, the I/O loop
    peers.py      the decode workers a sender talks to: one Peer per handshake, with its state
    sender_transfer.py   one transfer on the prefill side: its ladder (base.TransferState, base.MOVES), finish, abort
    receiver.py   the decode side every transport shares: handshake, reservations, deadlines, arrivals
    endpoint.py   the I/O thread behind each of them (ZMQ sockets, CURVE)
    plan.py       a request's move as paired runs of blocks; NIXL descriptors
    staging.py    nixl's staging for a fragmented request: when it stages, the regions' bookkeeping, the checks
                  of a grant and of a staged write (integers only); nixl_staging.py moves its bytes
    block_copy.py blocks copied by index in one pass (a Triton kernel): ipc's fragmented requests on a GPU,
                  zmq's frames of many runs, nixl's staged gathers and scatters
    frames.py     zmq's data frames: runs packed into frames (sender), a frame's header checked (receiver)
    ipc.py, nixl.py, zmq.py   the transports (zmq_transfer.py: zmq's prefill side; nixl_staging.py: nixl's
                  staged path);  fake.py   a real one with a fault, for tests
    ucx_log.py    which UCX lane a NIXL transfer took

How to add a transport `foo`
----------------------------
1. Name it: `FOO = "foo"` in protocol/enums.py Transport. The CLI choices, TransferConfig's check,
   the registry (it imports workers.transfer.foo) and the tests follow from that name.
2. If the sender needs to be told how to reach the decode pool (a handle, an address, agent
   metadata), add a tagged `FooInfo` struct to protocol/kv.py and to its TransportInfo union.
3. Write workers/transfer/foo.py, the smallest of ipc.py (copies on the caller's thread), zmq.py
   (frames on the I/O thread) or nixl.py (one-sided writes with notifications) as the model:

       class Receiver(ChannelReceiver):              # receiver.py's docstring has every hook
           transport = "foo"
           def _transport_info(self, hello): return P.FooInfo(...)

       class FooTransfer(SenderTransfer):            # sender_transfer.py's docstring has every hook
           def _post(self, layers): ...              # I/O thread: start the writes of these layers;
                                                     # return how many the receiver counts
       class Sender(ChannelSender):
           transport = "foo"
           info = (P.FooInfo,)
           transfer_class = FooTransfer
           def _attach(self, peer, welcome): ...     # map / register the pool welcome.info names

   Optional hooks, where the transport needs them: on the Receiver _setup_transport/_teardown_transport,
   _write_chunk (one_sided = False: the bytes come as frames), _progress (needs_progress = True),
   _accept/_landed/_report (something granted per request, as nixl's staging); on the Sender _detach,
   _setup_transport/_teardown_transport; on the transfer _move and _landed (copies made on the
   caller's thread, as ipc), _writes_in_flight and _drop_writes (writes that need checking, as nixl),
   begin/on_accept/let_go (asking for a grant, using it, giving back what it held). The bases do the rest: the layer_done guard, Begin/Accept/Done/Ack/
   Abort, deadlines, cancels, the queue of layers behind their CUDA events.
4. Test: tests/test_transfer.py runs every test on every name in Transport (bytes across
   processes, refusals, deadlines, the fake's faults, killed peers), tests/test_transfer_engine.py
   decodes from the transferred cache against a colocated run. Run both.
"""
