// Note [One call frame] (ctxpar/strategy.h): create(), and forward / backward written once for
// every algorithm -- check, agree, record, run, check the outputs.
#include <deque>
#include <functional>
#include <vector>

#include "ctxpar/agreement.h"
#include "device/kernel_agreement.h"
#include "strategy/internal.h"

namespace ctxpar {
namespace strategy {
namespace {

// Resets stats and snapshots the device's counters and the byte counters of `comms` at start;
// finish() synchronises the device and writes deltas, wall time and the memory peak.
class CallRecord {
 public:
  CallRecord(StrategyStats& stats, Device& device, std::vector<Communicator*> comms)
      : stats_(stats), device_(device), comms_(std::move(comms)) {
    stats_ = StrategyStats{};
    for (Communicator* c : comms_) {
      sent0_ += c->counters().bytes_sent;
      received0_ += c->counters().bytes_received;
    }
    device0_ = device_.counters();
    held0_ = device_.held_bytes();
    device_.reset_peak();
    t0_ = now_seconds();
  }

  void finish(const Run& run) {
    device_.synchronize();
    uint64_t sent = 0, received = 0;
    for (Communicator* c : comms_) {
      sent += c->counters().bytes_sent;
      received += c->counters().bytes_received;
    }
    const DeviceCounters d = device_.counters();
    stats_.bytes_sent = sent - sent0_;
    stats_.bytes_received = received - received0_;
    stats_.attention_flops = d.flops - device0_.flops;
    stats_.busy_seconds = d.busy_seconds - device0_.busy_seconds;
    stats_.comm_wait_seconds = d.wait_seconds - device0_.wait_seconds + run.host_wait_seconds;
    stats_.peak_bytes = device_.peak_bytes() - held0_;
    stats_.wall_seconds = now_seconds() - t0_;
  }

 private:
  StrategyStats& stats_;
  Device& device_;
  std::vector<Communicator*> comms_;
  uint64_t sent0_ = 0, received0_ = 0;
  DeviceCounters device0_;
  size_t held0_ = 0;
  double t0_ = 0;
};

// One call's scope, made after every rank agreed on the arguments (the agreement's small
// all-gather is done before the record starts counting, so it is not in the call's stats).
// finish() waits for the device and records time, bytes and peak memory; a call that throws
// still waits for its queued work before its buffers and the caller's tensors go.
class CallScope {
 public:
  CallScope(Device& device, StrategyStats& stats, const StrategyOptions& options,
            const Dims& dims, std::vector<Communicator*> counted)
      : record_(stats, device, std::move(counted)),
        call{dims, Run{&device, options.mask, options.kernel}} {}
  ~CallScope() {
    if (finished_) return;
    try {
      call.run.dev->synchronize();
    } catch (...) {  // the exception in flight says what went wrong first
    }
  }
  void finish() {
    finished_ = true;
    record_.finish(call.run);
  }

 private:
  CallRecord record_;
  bool finished_ = false;

 public:
  Call call;
};

}  // namespace

// The checks read arguments and results on the host; those a device holds in place in memory
// the host cannot read (Device::host_readable: the cuda device's adopted CUDA tensors) are
// checked in a host copy the device makes (views whose last dim is not contiguous are left
// as they are: their check fails on the stride before it reads anything).
class HostViews {
 public:
  explicit HostViews(Device& device) : device_(device) {}
  TensorView operator()(const TensorView& v) {
    if (v.empty() || device_.host_readable(v.data())) return v;
    if (v.ndim() == 4 && v.dim(3) > 1 && v.stride(3) != 1) return v;
    copies_.emplace_back(v.dtype(), v.shape());
    device_.copy(kComputeStream, v, copies_.back().view());
    return copies_.back().view();
  }
  // Waits for the copies (none: nothing to wait for).
  void ready() {
    if (!copies_.empty()) device_.synchronize();
  }

 private:
  Device& device_;
  std::deque<Tensor> copies_;
};

}  // namespace strategy

Strategy::Strategy(Communicator& comm, const StrategyOptions& options,
                   std::unique_ptr<Device> device)
    : comm_(comm), options_(options),
      device_(device ? std::move(device) : make_device(options.device, comm.rank())) {}

std::unique_ptr<Strategy> Strategy::create(Communicator& comm, const StrategyOptions& options) {
  return create(comm, options, nullptr);
}

std::unique_ptr<Strategy> Strategy::create(Communicator& comm, const StrategyOptions& options,
                                           std::unique_ptr<Device> device) {
  // Options are checked here and agreed on by every rank before hybrid's split (a collective).
  std::string error;
  const int p = comm.size();
  if (options.ulysses_degree < 0)
    error = detail::concat("ulysses_degree: expected >= 0 (0 = P), got ", options.ulysses_degree);
  else if (options.kind == StrategyKind::hybrid && options.ulysses_degree > 0 &&
           p % options.ulysses_degree != 0)
    error = detail::concat("hybrid: ulysses_degree u = ", options.ulysses_degree,
                           " must divide the number of ranks P = ", p,
                           " (ulysses groups of u ranks x ring over P/u groups)");
  else if (options.head_groups < 0)
    error = detail::concat("head_groups: expected >= 0 (0 = auto), got ", options.head_groups);
  else if (options.ulysses_groups < 0 || options.ulysses_groups > kMaxUlyssesGroups)
    error = detail::concat("ulysses_groups: expected 0 (the default) or 1..", kMaxUlyssesGroups,
                           " (the most head groups Ulysses pipelines its all-to-alls over), got ",
                           options.ulysses_groups);
  else if (options.kernel.threads < 1)
    error = detail::concat("kernel.threads: expected >= 1, got ", options.kernel.threads);
  else
    error = device::kernel_choices_error(options.kernel);
  require_agreement(comm, std::string(strategy_name(options.kind)) + " create",
                    strategy::signature_of(strategy::Dims{}, options), error);
  StrategyOptions agreed = options;
  device::agree_kernel_choices(comm, agreed.kernel);  // before hybrid splits: the whole job
  switch (agreed.kind) {
    case StrategyKind::ring: return strategy::make_ring(comm, agreed, std::move(device));
    case StrategyKind::allgather:
      return strategy::make_allgather(comm, agreed, std::move(device));
    case StrategyKind::ulysses: return strategy::make_ulysses(comm, agreed, std::move(device));
    case StrategyKind::hybrid: return strategy::make_hybrid(comm, agreed, std::move(device));
  }
  throw Error("unknown strategy kind");
}

void Strategy::in_frame(const char* call, const strategy::Dims& dims, std::string error,
                        const std::function<void(strategy::Call&)>& run,
                        const std::function<void(const std::string&)>& check_outputs) {
  const std::string what = std::string(strategy_name(options_.kind)) + " " + call;
  if (error.empty()) error = check_heads(dims.hq, dims.hkv);
  require_agreement(comm_, what, strategy::signature_of(dims, options_), error);
  strategy::CallScope scope(*device_, stats_, options_, dims, counted());
  run(scope.call);
  scope.finish();
  check_outputs(what);
}

void Strategy::forward(const ForwardArgs& args) {
  strategy::Dims dims;
  std::string error;
  {
    strategy::HostViews host(*device_);
    ForwardArgs checked = args;
    checked.q = host(args.q), checked.k = host(args.k), checked.v = host(args.v);
    host.ready();
    error = strategy::check_forward(checked, options_.mask, dims);
  }
  in_frame("forward", dims, std::move(error),
           [&](strategy::Call& call) { run_forward(args, call); },
           [&](const std::string& what) {
             strategy::HostViews host(*device_);
             const TensorView out = host(args.out), lse = host(args.lse);
             host.ready();
             strategy::agree_outputs(comm_, what,
                                     strategy::check_forward_outputs(out, lse, args.tokens));
           });
}

void Strategy::backward(const BackwardArgs& args) {
  strategy::Dims dims;
  std::string error;
  {
    strategy::HostViews host(*device_);
    BackwardArgs checked = args;
    checked.q = host(args.q), checked.k = host(args.k), checked.v = host(args.v);
    checked.dout = host(args.dout);
    host.ready();
    error = strategy::check_backward(checked, options_.mask, dims);
  }
  in_frame("backward", dims, std::move(error),
           [&](strategy::Call& call) { run_backward(args, call); },
           [&](const std::string& what) {
             strategy::HostViews host(*device_);
             const TensorView dq = host(args.dq), dk = host(args.dk), dv = host(args.dv);
             host.ready();
             strategy::agree_outputs(comm_, what,
                                     strategy::check_backward_outputs(dq, dk, dv, args.tokens));
           });
}

}  // namespace ctxpar
