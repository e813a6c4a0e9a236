"""The engine core in its own process: the API process keeps HTTP and tokenizing, the core process runs
the scheduler, the model runner and the step loop (and, with tensor parallelism, owns the other ranks).

    API process                                     engine-core process
    EngineCoreClient (EngineProtocol) ──PUSH──►    EngineCore: inbox → LLMEngine.step() → outbox
        per-request queues            ◄──PULL──    one StepOutputs message per step (all requests)

messages.py is the wire (msgspec msgpack over ZeroMQ ipc sockets), host_copies.py hands adapter weights
over in shared memory (data_plane/adapters/loading/transfer.py lays them out and maps them), threads.py
chooses the core's torch threads and CPU binding, process_main.py is the core process's entry point and
client.py the API side.
"""
