// Live recovery: a replica that joins a fault-tolerant job (restarted, or one more) takes
// every stateful component's state from a healthy replica over the process group, with no
// checkpoint read (TorchFT's recovery from a peer). The source saves its components into
// memory as it would into a checkpoint (checkpoint/stateful.hpp), broadcasts a header of
// names, types and shapes and sends each tensor to each joiner; the joiners load them back
// in the same order (straight into the joiner's own state's memory where it holds the same
// tensors), the other members take part in the header's collectives only and keep their own.
// The source hashes the state it sends as it goes, the joiners theirs once loaded: a joiner
// whose hash is not the source's must not train.
//
// Where a replica's own ranks split its state (tensor parallelism inside it), each rank
// hands over its part over its place's group to the joiner's rank at the same place, whose
// part is the same; where its data ranks shard it (ZeRO inside a replica), each hands its
// shard's ranges to the joiner's data rank at the same place, whose shard is the same.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/stateful.hpp"
#include "comm/comm.hpp"

namespace dtrain {

// The hashes a hand-over ends with: this member's state's (where it sent or took the state;
// 0 for a member that only took part) and the source's; and, for a joiner, what it took
// (and of that, what went into the tensors its own save gave, its live state where they
// are views of it) and how long taking (the transfer and the load) and hashing it lasted.
struct Handover {
  uint64_t mine = 0, source = 0;
  int64_t bytes = 0, in_place = 0;
  double seconds = 0, hash_seconds = 0;
  bool identical() const { return mine == source; }
};

// Collective over `group`: the `parts` of group rank `source` into those of the members
// that `receive`. `layout`: the replicas' (the same on both sides); `config_yaml`: this
// member's resolved job, the source's checked by the joiners as a resume checks a
// checkpoint's; `device`: this rank's, where a joiner takes what the source keeps on a GPU.
// A failure of the group's collectives may show as an exception or as a garbled result:
// the caller knows its group.
Handover hand_over(const std::vector<Stateful*>& parts, Comm& group, int64_t source,
                   bool receive, const ParallelDims& layout, const std::string& config_yaml,
                   c10::Device device = c10::Device(c10::kCPU));

// The hash of `parts`' state as a checkpoint would save it: tensors' bytes and the
// trainer entries, in order.
uint64_t state_hash(const std::vector<Stateful*>& parts);

}  // namespace dtrain
