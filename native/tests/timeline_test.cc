// Horovod's timeline writer (requests/timeline.cc): the file is one valid JSON array (while
// recording and once stopped), B/E events are well nested on every row whatever the producer
// sends, names are escaped, and a full queue drops records (counted, marked) without blocking.
#include "requests/timeline.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "requests/message.h"

namespace bagua_hvd {
namespace {

// A small strict JSON parser: enough to prove the file loads and to read its events.
struct Json {
  enum Type { kNull, kBool, kNumber, kString, kArray, kObject } type = kNull;
  double number = 0;
  std::string str;
  std::vector<Json> items;        // array items, or object values
  std::vector<std::string> keys;  // object keys
  const Json* get(const std::string& k) const {
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == k) return &items[i];
    return nullptr;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}
  bool parse(Json* out) {
    if (!value(out)) return false;
    ws();
    return i_ == s_.size();
  }

 private:
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r'))
      ++i_;
  }
  bool lit(const char* w) {
    const std::string word(w);
    if (s_.compare(i_, word.size(), word) != 0) return false;
    i_ += word.size();
    return true;
  }
  bool string(std::string* out) {
    if (i_ >= s_.size() || s_[i_] != '"') return false;
    for (++i_; i_ < s_.size(); ++i_) {
      const char c = s_[i_];
      if (c == '"') {
        ++i_;
        return true;
      }
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c == '\\') {
        if (++i_ >= s_.size()) return false;
        const char e = s_[i_];
        if (e == 'u') {
          if (i_ + 4 >= s_.size()) return false;
          out->push_back(static_cast<char>(std::stoi(s_.substr(i_ + 1, 4), nullptr, 16)));
          i_ += 4;
        } else if (e == '"' || e == '\\' || e == '/') {
          out->push_back(e);
        } else if (e == 'n') {
          out->push_back('\n');
        } else {
          return false;
        }
      } else {
        out->push_back(c);
      }
    }
    return false;
  }
  // The items of an object (keyed) or an array, after its opening bracket.
  bool items(Json* v, char close) {
    ++i_;
    ws();
    if (i_ < s_.size() && s_[i_] == close) return ++i_, true;
    while (true) {
      ws();
      if (close == '}') {
        std::string k;
        if (!string(&k)) return false;
        ws();
        if (i_ >= s_.size() || s_[i_++] != ':') return false;
        v->keys.push_back(k);
      }
      Json item;
      if (!value(&item)) return false;
      v->items.push_back(std::move(item));
      ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      return i_ < s_.size() && s_[i_++] == close;
    }
  }
  bool value(Json* v) {
    ws();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{' || c == '[') {
      v->type = c == '{' ? Json::kObject : Json::kArray;
      return items(v, c == '{' ? '}' : ']');
    }
    if (c == '"') {
      v->type = Json::kString;
      return string(&v->str);
    }
    if (lit("true") || lit("false")) return v->type = Json::kBool, true;
    if (lit("null")) return true;
    size_t used = 0;
    try {
      v->number = std::stod(s_.substr(i_, 32), &used);
    } catch (...) {
      return false;
    }
    v->type = Json::kNumber;
    i_ += used;
    return true;
  }
  const std::string& s_;
  size_t i_ = 0;
};

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Trace {
  std::vector<const Json*> events;
  std::map<int, std::string> rows;         // pid -> tensor name
  std::map<std::string, std::string> seq;  // tensor name -> "B:NAME E ..." in order
  int markers = 0;
  int dropped_markers = 0;
};

// Parses path (must be valid JSON), checks B/E nesting per row (and, once stopped, that nothing
// is left open), summarizes.
void load(const std::string& path, Json* root, Trace* t, bool stopped = true) {
  const std::string text = read_file(path);
  ASSERT_TRUE(Parser(text).parse(root)) << text;
  ASSERT_EQ(root->type, Json::kArray);
  std::map<int, int> depth;
  for (const Json& e : root->items) {
    ASSERT_EQ(e.type, Json::kObject);
    const std::string ph = e.get("ph")->str;
    const Json* pid = e.get("pid");
    const int p = pid ? static_cast<int>(pid->number) : 0;
    if (ph == "M" && e.get("name")->str == "process_name" && e.get("args")->get("name"))
      t->rows[p] = e.get("args")->get("name")->str;
    if (ph == "B" || ph == "E" || ph == "X") {
      ASSERT_TRUE(t->rows.count(p)) << "event before its row's metadata";
      std::string& s = t->seq[t->rows[p]];
      if (ph == "B") {
        ++depth[p];
        s += "B:" + e.get("name")->str + " ";
      } else if (ph == "E") {
        ASSERT_GT(depth[p], 0) << "E without B on " << t->rows[p];
        --depth[p];
        s += "E ";
      } else {
        s += "X:" + e.get("name")->str + " ";
      }
    }
    if (ph == "i" && e.get("name")->str == "CYCLE_START") ++t->markers;
    if (ph == "i" && e.get("name")->str == "TIMELINE_RECORDS_DROPPED") ++t->dropped_markers;
  }
  if (!stopped) return;
  for (const auto& kv : depth) EXPECT_EQ(kv.second, 0) << "left open on " << t->rows[kv.first];
}

std::string temp_path(const char* tag) {
  return ::testing::TempDir() + "bhvd_timeline_" + tag + "_" + std::to_string(getpid()) + ".json";
}

TEST(Timeline, OffUntilStartedAndHorovodPhasesInOrder) {
  Timeline tl;
  EXPECT_FALSE(tl.active());
  const std::string path = temp_path("phases");
  ASSERT_TRUE(tl.start(path, true).ok());
  EXPECT_TRUE(tl.active());
  const std::string odd = tensor_key(0, "allreduce.we\"ird\\name");
  for (const std::string& key : {tensor_key(0, "allreduce.a"), odd}) {
    tl.negotiate_begin(key, BHVD_OP_ALLREDUCE);
    tl.negotiate_rank(key, 1);
    tl.negotiate_rank(key, 0);
    tl.negotiate_end(key);
  }
  tl.mark_cycle();
  const uint64_t g = tl.op_begin({tensor_key(0, "allreduce.a"), odd}, BHVD_OP_ALLREDUCE,
                                 static_cast<int32_t>(DataType::FLOAT32));
  ASSERT_NE(g, 0u);
  tl.activity_begin(g, kTlQueue);
  tl.activity_end(g);
  tl.activity_begin(g, kTlMemcpyIn);
  tl.activity_begin(g, "GLOO_ALLREDUCE");  // without the end: the writer closes MEMCPY_IN
  tl.activity_end(g);
  tl.activity_begin(g, kTlMemcpyOut);
  tl.op_end(g);  // closes MEMCPY_OUT and ALLREDUCE
  tl.stop();
  EXPECT_FALSE(tl.active());
  Json root;
  Trace t;
  load(path, &root, &t);
  const std::string want =
      "B:NEGOTIATE_ALLREDUCE X:1 X:0 E B:ALLREDUCE B:QUEUE E B:MEMCPY_IN_FUSION_BUFFER E "
      "B:GLOO_ALLREDUCE E B:MEMCPY_OUT_FUSION_BUFFER E E ";
  EXPECT_EQ(t.seq["allreduce.a"], want);
  EXPECT_EQ(t.seq["allreduce.we\"ird\\name"], want);
  EXPECT_EQ(t.markers, 1);
  // Horovod's first record: pid 0's process_name with the start time.
  ASSERT_NE(root.items[0].get("args")->get("start_time_since_epoch_in_micros"), nullptr);
  // The top-level end carries the dtype.
  int with_dtype = 0;
  for (const Json& e : root.items)
    if (e.get("args") && e.get("args")->get("dtype")) ++with_dtype;
  EXPECT_EQ(with_dtype, 2);
  std::remove(path.c_str());
}

TEST(Timeline, OpEndCarriesTheBytesSent) {
  Timeline tl(1024, 5);
  const std::string path = temp_path("bytes");
  ASSERT_TRUE(tl.start(path, false).ok());
  const uint64_t sent = tl.op_begin({tensor_key(0, "allreduce.sent")}, BHVD_OP_ALLREDUCE,
                                    static_cast<int32_t>(DataType::FLOAT32));
  const uint64_t none = tl.op_begin({tensor_key(0, "allreduce.none")}, BHVD_OP_ALLREDUCE,
                                    static_cast<int32_t>(DataType::FLOAT32));
  tl.op_end(sent, WireCounts{1, 12, 34});
  tl.op_end(none);  // no scope counted: the dtype alone
  tl.stop();
  Json root;
  Trace t;
  load(path, &root, &t);
  int with_bytes = 0, dtype_only = 0;
  for (const Json& e : root.items) {
    const Json* args = e.get("args");
    if (!args || !args->get("dtype")) continue;
    if (const Json* w = args->get("within_host_bytes_sent")) {
      ++with_bytes;
      EXPECT_EQ(w->number, 12);
      ASSERT_NE(args->get("between_hosts_bytes_sent"), nullptr);
      EXPECT_EQ(args->get("between_hosts_bytes_sent")->number, 34);
    } else {
      ++dtype_only;
    }
  }
  EXPECT_EQ(with_bytes, 1);
  EXPECT_EQ(dtype_only, 1);
  std::remove(path.c_str());
}

TEST(Timeline, ValidJsonWhileRecordingAndOpenEventsClosedAtStop) {
  Timeline tl(1024, 5);
  const std::string path = temp_path("live");
  ASSERT_TRUE(tl.start(path, false).ok());
  const std::string key = tensor_key(2, "allgather.x");
  tl.negotiate_begin(key, BHVD_OP_ALLGATHER);
  const uint64_t g = tl.op_begin({key}, BHVD_OP_ALLGATHER, 7);  // closes the negotiation
  tl.activity_begin(g, "GLOO_ALLGATHER");
  tl.mark_cycle();  // mark_cycles off: nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  {
    Json root;
    Trace t;
    load(path, &root, &t, false);  // still recording: valid JSON, nested so far
    EXPECT_EQ(t.seq["allgather.x (process set 2)"],
              "B:NEGOTIATE_ALLGATHER E B:ALLGATHER B:GLOO_ALLGATHER ");
  }
  tl.stop();  // ALLGATHER and its activity still open: closed here
  Json root;
  Trace t;
  load(path, &root, &t);
  EXPECT_EQ(t.seq["allgather.x (process set 2)"],
            "B:NEGOTIATE_ALLGATHER E B:ALLGATHER B:GLOO_ALLGATHER E E ");
  EXPECT_EQ(t.markers, 0);
  // Records after the stop go nowhere; an end without a begin is dropped.
  tl.activity_end(g);
  tl.op_end(g);
  EXPECT_EQ(tl.op_begin({key}, BHVD_OP_ALLGATHER, 7), 0u);
  ASSERT_TRUE(tl.start(path, false).ok());  // a new file
  tl.negotiate_end(key);
  tl.op_end(g);
  tl.shutdown();
  Json root2;
  Trace t2;
  load(path, &root2, &t2);
  EXPECT_TRUE(t2.seq.empty());
  std::remove(path.c_str());
}

TEST(Timeline, UnwritablePathIsAnErrorAndStaysOff) {
  Timeline tl;
  Status s = tl.start("/nonexistent-dir/x/timeline.json", false);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.reason.find("Error opening the Horovod Timeline file"), std::string::npos);
  EXPECT_FALSE(tl.active());
}

TEST(Timeline, FullQueueDropsWithoutBlockingAndStaysWellNested) {
  Timeline tl(4, 1000);  // four records; the writer wakes at two, or every second
  const std::string path = temp_path("full");
  ASSERT_TRUE(tl.start(path, true).ok());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20000; ++i) {
    const std::string key = tensor_key(0, "allreduce.t" + std::to_string(i % 7));
    tl.negotiate_begin(key, BHVD_OP_ALLREDUCE);
    tl.negotiate_rank(key, 0);
    tl.negotiate_end(key);
    const uint64_t g = tl.op_begin({key}, BHVD_OP_ALLREDUCE, 7);
    tl.activity_begin(g, kTlMemcpyIn);
    tl.activity_end(g);
    tl.activity_begin(g, "GLOO_ALLREDUCE");
    tl.op_end(g);
    tl.mark_cycle();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 10.0);  // never waits for the writer
  EXPECT_GT(tl.dropped(), 0);
  tl.stop();
  Json root;
  Trace t;
  load(path, &root, &t);  // valid, and nested on every row despite the lost records
  EXPECT_GT(t.dropped_markers, 0);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace bagua_hvd
