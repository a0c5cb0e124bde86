// Crafted and corrupt checkpoint files, as a hostile user or a bad disk would give them to
// --resume: every one is refused with a ctxpar::Error naming the file and what is wrong;
// nothing crashes, reads past a buffer (run under valgrind by hand: see docs/training.md) or
// loads silently.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/untrusted_json.h"
#include "model/params.h"
#include "model/train_support.h"
#include "model/training.h"

namespace ctxpar {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A safetensors file with exactly this header (padded to 8 bytes) and data section, or with
// a header length of `len` when given.
void write_raw(const std::string& path, const json& header, const std::string& data,
               uint64_t len = 0) {
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  if (len == 0) len = text.size();
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(char(len >> (8 * i)));
  out << text << data;
}

class CheckpointFile : public test::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    config_ = test::small_train_config();
    model::init_params(config_.model, weights_, 1);
    adam_.m.assign(weights_.size(), 0.01f);
    adam_.v.assign(weights_.size(), 0.0001f);
    adam_.step = 3;
    good_ = path("good.safetensors");
    model::save_checkpoint(good_, config_, weights_, adam_);
    const std::string raw = slurp(good_);
    uint64_t len = 0;
    for (int i = 0; i < 8; ++i) len |= uint64_t(uint8_t(raw[i])) << (8 * i);
    header_ = json::parse(raw.substr(8, len));
    data_ = raw.substr(8 + len);
  }
  // The error of --resume from `file` ("" if it loads).
  std::string load_error(const std::string& file) {
    std::vector<float> w;
    model::AdamState a;
    try {
      model::load_checkpoint(file, config_, w, a);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  // The good checkpoint with its header edited by `edit`, the checksum removed and the format
  // that of a file written before checksums (ctxpar-train-1, which loads without one): only
  // the range and type checks stand between the edit and a load.
  std::string edited(const std::function<void(json&)>& edit) {
    json h = header_;
    h["__metadata__"].erase("checksum");
    h["__metadata__"]["format"] = "ctxpar-train-1";
    edit(h);
    const std::string p = path("edited.safetensors");
    write_raw(p, h, data_);
    return p;
  }
  // The edited() checkpoint with the JSON string "DEEP" (placed by `edit`) replaced by arrays
  // nested `depth` levels deep, written as text: nlohmann::json would recurse building it.
  std::string deepened(const std::function<void(json&)>& edit, size_t depth) {
    json h = header_;
    h["__metadata__"].erase("checksum");
    h["__metadata__"]["format"] = "ctxpar-train-1";
    edit(h);
    std::string text = h.dump();
    const size_t at = text.find("\"DEEP\"");
    EXPECT_NE(at, std::string::npos);
    text.replace(at, 6, std::string(depth, '[') + std::string(depth, ']'));
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::string p = path("deep.safetensors");
    std::ofstream out(p, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(char(uint64_t(text.size()) >> (8 * i)));
    out << text << data_;
    return p;
  }
  // The good checkpoint saved again with other values (a valid file, checksum and all).
  std::string resaved(const std::function<void()>& change) {
    change();
    const std::string p = path("resaved.safetensors");
    model::save_checkpoint(p, config_, weights_, adam_);
    return p;
  }
  void expect_refused(const std::string& file, const std::string& words) {
    const std::string e = load_error(file);
    EXPECT_NE(e.find(file), std::string::npos) << "the error must name the file: " << e;
    EXPECT_NE(e.find(words), std::string::npos) << "expected '" << words << "' in: " << e;
  }
  size_t offset_of(const std::string& name) const {
    for (const auto& p : model::param_infos(config_.model))
      if (p.name == name) return p.offset;
    ADD_FAILURE() << "no parameter " << name;
    return 0;
  }

  TrainConfig config_;
  std::vector<float> weights_;
  model::AdamState adam_;
  std::string good_;
  json header_;
  std::string data_;
};

TEST_F(CheckpointFile, GoodFileLoadsWithItsChecksum) {
  EXPECT_EQ(load_error(good_), "");
  EXPECT_TRUE(model::read_safetensors(good_).checksummed);
  EXPECT_EQ(header_["__metadata__"]["checksum"].get<std::string>().rfind("fnv1a64:", 0), 0u);
}

// The 192 invalid reads valgrind found: a range shorter than dtype x shape was memcpy'd whole.
TEST_F(CheckpointFile, RangeShorterThanTheShapeIsRefused) {
  expect_refused(edited([](json& h) {
                   h["final_norm"]["data_offsets"][1] =
                       h["final_norm"]["data_offsets"][0].get<uint64_t>() + 64;
                 }),
                 "hold 64 bytes, its dtype F32 and shape [32] need 128");
}

TEST_F(CheckpointFile, ZeroLengthRangeIsRefused) {  // segfaulted (exit 139)
  expect_refused(edited([](json& h) {
                   h["layers.0.wq"]["data_offsets"][1] = h["layers.0.wq"]["data_offsets"][0];
                 }),
                 "tensor layers.0.wq: data_offsets");
}

TEST_F(CheckpointFile, RangeEndingBeforeItBeginsIsRefused) {
  expect_refused(edited([](json& h) {
                   h["embed"]["data_offsets"] = {100, 4};
                 }),
                 "end before they begin");
}

TEST_F(CheckpointFile, OverlappingRangesAreRefused) {
  // Two [32] tensors read from the same bytes: each range is the right size, together they
  // leave a hole elsewhere.
  expect_refused(edited([](json& h) {
                   h["layers.0.mlp_norm"]["data_offsets"] = h["layers.0.attn_norm"]["data_offsets"];
                 }),
                 "overlap");
}

TEST_F(CheckpointFile, RangePastTheEndOfTheFileIsRefused) {
  expect_refused(edited([](json& h) {
                   for (auto& [name, e] : h.items())
                     if (name != "__metadata__")
                       for (auto& o : e["data_offsets"]) o = o.get<uint64_t>() + (1u << 20);
                 }),
                 "is truncated: tensor");
}

TEST_F(CheckpointFile, ShapeWhoseByteCountOverflowsIsRefused) {
  expect_refused(edited([](json& h) {
                   h["final_norm"]["shape"] = {uint64_t(1) << 62, 8};
                 }),
                 "overflows 64 bits");
}

TEST_F(CheckpointFile, WrongJsonTypesAreRefused) {
  expect_refused(edited([](json& h) { h["final_norm"]["shape"] = "32"; }), "shape must be a list");
  expect_refused(edited([](json& h) { h["final_norm"]["shape"] = {-32}; }),
                 "non-negative integers");
  expect_refused(edited([](json& h) { h["final_norm"]["dtype"] = 4; }), "dtype must be a string");
  expect_refused(edited([](json& h) { h["final_norm"]["dtype"] = "F31"; }), "unknown dtype");
  expect_refused(edited([](json& h) { h["final_norm"]["data_offsets"] = {0}; }), "[begin, end]");
  expect_refused(edited([](json& h) { h["final_norm"] = 7; }), "needs an object");
  expect_refused(edited([](json& h) { h["__metadata__"]["step"] = 3; }), "must be a string");
  const std::string p = path("array.safetensors");
  write_raw(p, json::array({1, 2}), "");
  expect_refused(p, "malformed header");
}

// 100000 nested brackets (a 200 kB header) overflowed the stack (SIGSEGV) in whatever first
// copied or printed them: the error message for a bad __metadata__ entry or tensor shape, or,
// under a key the loader never reads, the copy the checksum makes. Refused before parsing,
// naming the file, the depth and the limit.
TEST_F(CheckpointFile, DeeplyNestedHeaderIsRefusedNotACrash) {
  const std::string words = "has a header nested 100002 levels deep, over the limit of 64";
  expect_refused(deepened([](json& h) { h["__metadata__"]["note"] = "DEEP"; }, 100000), words);
  expect_refused(deepened([](json& h) { h["final_norm"]["shape"] = "DEEP"; }, 100000), words);
  expect_refused(deepened([](json& h) { h["final_norm"]["unread"] = "DEEP"; }, 100000), words);
  expect_refused(deepened([](json& h) { h["final_norm"]["unread"] = "DEEP"; }, 100000),
                 "resume from another checkpoint or start fresh");
}

// The limit is on the whole header: 64 levels load (a key the loader never reads, 2 levels
// down, holding 62), 65 do not.
TEST_F(CheckpointFile, HeaderNestedToTheLimitLoads) {
  EXPECT_EQ(io::json_nesting_depth(header_.dump()), 3u);  // {tensor: {shape: [...]}}
  EXPECT_EQ(load_error(deepened([](json& h) { h["final_norm"]["unread"] = "DEEP"; }, 62)), "");
  expect_refused(deepened([](json& h) { h["final_norm"]["unread"] = "DEEP"; }, 63),
                 "has a header nested 65 levels deep, over the limit of 64");
}

// The pre-scan counts brackets outside strings only, so a string full of brackets is not
// "deep" and an escaped quote does not end a string early.
TEST(UntrustedJson, DepthCountsBracketsOutsideStrings) {
  EXPECT_EQ(io::json_nesting_depth(""), 0u);
  EXPECT_EQ(io::json_nesting_depth("7"), 0u);
  EXPECT_EQ(io::json_nesting_depth("{}"), 1u);
  EXPECT_EQ(io::json_nesting_depth(R"({"a": [1, {"b": []}], "c": {}})"), 4u);
  EXPECT_EQ(io::json_nesting_depth(R"({"a": "[[[[{{{{"})"), 1u);
  EXPECT_EQ(io::json_nesting_depth(R"({"a\\": "[", "b\"[[": [[]]})"), 3u);
  EXPECT_EQ(io::json_nesting_depth(R"({"a\\\"[[[": 1})"), 1u);
}

TEST_F(CheckpointFile, HeaderLengthPastTheFileIsRefused) {
  for (uint64_t len : {uint64_t(1) << 63, uint64_t(~0ull), uint64_t(slurp(good_).size())}) {
    const std::string p = path("huge.safetensors");
    write_raw(p, header_, data_, len);
    expect_refused(p, "is truncated: header says");
  }
}

TEST_F(CheckpointFile, FolderShortFileAndFifoAreRefused) {
  expect_refused(dir_.string(), "is a folder");  // read an uninitialised header length
  const std::string short_file = path("short.safetensors");
  std::ofstream(short_file) << "abc";
  expect_refused(short_file, "not even the 8-byte header length");
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused(fifo, "not a regular file");  // and does not block waiting for a writer
}

// Every single-bit flip, in the header or the data, is refused naming the file. Sampled: every
// 7th byte of the length and header (the flipped bit rotating through all 8), 64 bytes across
// the data, and the last byte.
TEST_F(CheckpointFile, FlippedBitIsRefused) {
  const std::string raw = slurp(good_);
  const size_t data_start = raw.size() - data_.size();
  std::vector<size_t> where;
  for (size_t i = 0; i < data_start; i += 7) where.push_back(i);
  for (size_t k = 0; k < 64; ++k) where.push_back(data_start + k * data_.size() / 64);
  where.push_back(raw.size() - 1);
  const std::string p = path("flipped.safetensors");
  size_t refused = 0;
  for (size_t i : where) {
    std::string bad = raw;
    bad[i] = char(uint8_t(bad[i]) ^ (1u << (i % 8)));
    std::ofstream(p, std::ios::binary) << bad;
    const std::string e = load_error(p);
    refused += !e.empty();
    EXPECT_NE(e.find(p), std::string::npos) << "byte " << i << " bit " << i % 8 << ": " << e;
  }
  EXPECT_EQ(refused, where.size());
  // A flip in the data names the checksum.
  std::string bad = raw;
  bad[data_start + 100] ^= 1;
  std::ofstream(p, std::ios::binary) << bad;
  expect_refused(p, "fails its checksum");
}

TEST_F(CheckpointFile, MissingChecksumIsRefused) {
  expect_refused(edited([](json& h) { h["__metadata__"]["format"] = "ctxpar-train-2"; }),
                 "has no checksum");
  // A file written before checksums existed (format ctxpar-train-1) still loads.
  EXPECT_EQ(load_error(edited([](json&) {})), "");
}

TEST_F(CheckpointFile, StepThatIsNotANonNegativeIntegerIsRefused) {
  expect_refused(resaved([&] { adam_.step = -3; }), "step '-3' is not a non-negative integer");
  for (const char* step : {"2.5", "", "7abc", "99999999999999999999"}) {
    model::SafetensorsFile f = model::read_safetensors(good_);
    std::vector<model::NamedTensor> tensors;
    for (const auto& [name, t] : f.tensors)
      tensors.push_back({name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
    f.metadata["step"] = step;
    f.metadata.erase("checksum");
    const std::string p = path("step.safetensors");
    model::write_safetensors(p, tensors, f.metadata);
    expect_refused(p, "is not a non-negative integer");
  }
}

TEST_F(CheckpointFile, NonFiniteWeightsAndMomentsAreRefusedNamingTheTensor) {
  const size_t wq = offset_of("layers.0.wq");
  expect_refused(resaved([&] { weights_[wq + 5] = NAN; }),
                 "tensor layers.0.wq holds nan at index 5");
  weights_[wq + 5] = 0.0f;
  expect_refused(resaved([&] { adam_.m[3] = INFINITY; }),
                 "tensor adam.m.embed holds inf at index 3");
  adam_.m[3] = 0.0f;
  expect_refused(resaved([&] { adam_.v[wq + 2] = NAN; }), "tensor adam.v.layers.0.wq holds nan");
}

TEST_F(CheckpointFile, NegativeSecondMomentIsRefusedNamingTheTensor) {
  const size_t w2 = offset_of("layers.0.w2");
  expect_refused(resaved([&] { adam_.v[w2 + 7] = -0.5f; }),
                 "tensor adam.v.layers.0.w2 holds -0.5 at index 7, but Adam's second moment");
  // A negative first moment is an ordinary value.
  adam_.v[w2 + 7] = 0.0f;
  EXPECT_EQ(load_error(resaved([&] { adam_.m[w2 + 7] = -0.5f; })), "");
}

}  // namespace
}  // namespace ctxpar
