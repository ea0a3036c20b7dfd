// parallel.mode: async_ps, the asynchronous parameter server (Dean et al. 2012's Downpour;
// MXNet's kvstore, Marian's asynchronous training), with bounded staleness (stale
// synchronous parallel, Ho et al. 2013).
//
// The job's first parallel.servers ranks are servers; they hold the parameters, each
// updating one contiguous range of the flat buffer with the job's optimizer, whose state
// is therefore sharded over them. The other ranks are workers: each pulls the parameters,
// computes the gradient of its shard of a global batch (as a data-parallel rank would), and
// pushes it: to every server its range, to server 0 a header (the version the gradient was
// computed on, its loss and norm, a stop vote). Workers never wait for one another; a
// server applies each push as it arrives, then answers the worker with the parameters.
//
//   versions   every push applied is one version; a "step" is one push per worker (a
//              global batch's worth of samples), so train.max_steps, epochs and the
//              evaluation and checkpoint cadence keep their meaning. A push is applied at
//              the learning rate of its step over the number of workers: W pushes of one
//              lock-step round move the weights as far as one synchronous step, and with
//              plain SGD exactly as far (the test's reference).
//   staleness  a worker's reply is held while it is more than parallel.staleness pushes
//              ahead of the slowest worker, so a gradient is never computed on parameters
//              more than about (staleness + 1) x workers versions old; 0 is lock-step.
//              The staleness each applied gradient had (versions between the one it was
//              computed on and the one it was applied to) is reported.
//   order      server 0 sequences: it tells the other servers, in order, which push to
//              apply, which worker to answer, when to evaluate and checkpoint, so every
//              server's range is at the same version at each of those: a checkpoint or an
//              evaluation sees one consistent model.
//   the run    server 0 is the job's rank 0: it writes metrics.jsonl and the checkpoints
//              (the servers' parameters and optimizer state, and each worker's pushes: its
//              data position) and evaluates with the other servers at step boundaries.
//
// Every wait is bounded by dist.timeout_s; a worker or server that dies ends the job with
// exit 4 naming it, and --max-restarts resumes it from the newest checkpoint.
#pragma once
#include "train/context.hpp"
#include "train/runner.hpp"

namespace dtrain {

// This rank's part of an async_ps job, after setup(): server 0's, another server's or a
// worker's. Every rank ends with the same exit code (server 0's decision).
RunResult run_async_ps(Context& c);

}  // namespace dtrain
