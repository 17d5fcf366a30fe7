// SPDX-License-Identifier: Apache-2.0
// Hostile input for every command and parser of `kvport`: truncated,
// malformed, deeply nested, oversized and non-UTF-8 configs, wrong JSON types,
// overflowing sizes and counts, NaN fractions, unknown names, empty values,
// and files that are not files. Every case must give the bad-input contract of
// cli_test_util.hpp (exit 2, empty stdout, ONE "kvport: error: " line naming
// the problem), and that line must be printable and short: no crash, no hang,
// no trace, no silent wrong result.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "cli_test_util.hpp"
#include "kvport/cli/model_spec.hpp"

namespace kvport::cli::testing {
namespace {

using ::testing::HasSubstr;

// "kvport: error: " + at most 1000 bytes + "..." + '\n' (text::one_line).
constexpr std::size_t kMaxErrorLine = 15 + 1000 + 3 + 1;

// Whether `s` is well-formed UTF-8 without control characters other than
// the final line break.
bool printable_line(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\n' && i + 1 == s.size()) return true;
    if (c < 0x20 || c == 0x7F) return false;
    std::size_t n = 1;
    if (c >= 0xC2 && c <= 0xDF) {
      n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 3;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4;
    } else if (c >= 0x80) {
      return false;
    }
    if (i + n > s.size()) return false;
    for (std::size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    if (n == 2 && c == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0) return false;  // C1
    i += n;
  }
  return false;  // no final line break
}

// The bad-input contract, plus: the line is printable UTF-8 and bounded.
void expect_rejected(const CliResult& r, std::string_view needle) {
  expect_bad_input(r, needle);
  EXPECT_TRUE(printable_line(r.err)) << r.err;
  EXPECT_LE(r.err.size(), kMaxErrorLine);
}

struct Case {
  std::vector<std::string> args;
  std::string needle;
};

std::string describe(const std::vector<std::string>& args) {
  std::string out = "kvport";
  for (const std::string& arg : args) {
    out += " '";
    out += arg.size() > 80 ? arg.substr(0, 77) + "..." : arg;
    out += "'";
  }
  return out;
}

void expect_all_rejected(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c.args));
    expect_rejected(run_cli(c.args), c.needle);
  }
}

// `kvport plan --hf-config config.json --memory 1GiB` with the file rewritten
// for each case: a fresh folder per case would cost more than the case.
class ConfigFile {
 public:
  CliResult plan(std::string_view text) const {
    std::ofstream(file_.path(), std::ios::binary | std::ios::trunc) << text;
    return run_cli({"plan", "--hf-config", file_.path(), "--memory", "1GiB"});
  }

 private:
  TempFile file_{"config.json", ""};
};

CliResult plan_with_config(std::string_view text) {
  return ConfigFile().plan(text);
}

void expect_configs_rejected(const std::vector<std::pair<std::string, std::string>>& cases) {
  const ConfigFile config;
  for (const auto& [text, needle] : cases) {
    SCOPED_TRACE(text.size() > 120 ? text.substr(0, 117) + "..." : text);
    expect_rejected(config.plan(text), needle);
  }
}

// A small config with every kind of JSON token.
constexpr std::string_view kValidConfig =
    R"({"_name_or_path": "org/tiny", "model_type": "llama", "num_hidden_layers": 2,
"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256, "head_dim": null,
"rope_scaling": {"factor": 8.0, "type": "llama3"}, "tie_word_embeddings": false,
"extra": [1, -2.5e-3, "x\u00e9\n", true, null, {}, []]})";

// {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
//  "hidden_size": 256} with `field` set to `value` (added when absent).
std::string config_with(std::string_view field, std::string_view value) {
  std::vector<std::pair<std::string, std::string>> fields = {{"num_hidden_layers", "2"},
                                                             {"num_attention_heads", "4"},
                                                             {"num_key_value_heads", "2"},
                                                             {"hidden_size", "256"}};
  bool found = false;
  for (auto& [key, v] : fields) {
    if (key == field) {
      v = value;
      found = true;
    }
  }
  if (!found) fields.emplace_back(field, value);
  std::string text = "{";
  for (const auto& [key, v] : fields) {
    if (text.size() > 1) text += ", ";
    text += "\"" + key + "\": " + v;
  }
  return text + "}";
}

// Number-like text that is not a count > 0: for every flag that takes one.
const std::vector<std::string>& bad_counts() {
  static const std::vector<std::string> values = {"",
                                                  " ",
                                                  "-1",
                                                  "-0",
                                                  "0",
                                                  "+1",
                                                  "1.5",
                                                  "1e3",
                                                  "0x10",
                                                  "abc",
                                                  "12abc",
                                                  "1 2",
                                                  "18446744073709551616",
                                                  "99999999999999999999999",
                                                  "nan",
                                                  "inf",
                                                  "\xd9\xa1",  // ARABIC-INDIC DIGIT ONE
                                                  "\xff"};
  return values;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// --- The model config file -------------------------------------------------

TEST(cli_hostile_config, EveryTruncationOfAValidConfigIsRejected) {
  const CliResult whole = plan_with_config(kValidConfig);
  ASSERT_EQ(whole.code, 0) << whole.err;
  EXPECT_THAT(whole.out, HasSubstr("org/tiny (hf-config): 2 layers, 2 KV heads, head dim 64"));
  // The closing brace comes last, so every proper prefix is cut short.
  const ConfigFile config;
  for (std::size_t n = 0; n < kValidConfig.size(); ++n) {
    SCOPED_TRACE(n);
    expect_rejected(config.plan(kValidConfig.substr(0, n)), "not valid JSON");
  }
}

TEST(cli_hostile_config, MalformedJson) {
  expect_configs_rejected({
      {"{", "not valid JSON"},
      {"}", "not valid JSON"},
      {R"({"num_hidden_layers":})", "not valid JSON"},
      {R"({"num_hidden_layers" 2})", "not valid JSON"},
      {R"({"num_hidden_layers": 2,})", "not valid JSON"},
      {R"({'num_hidden_layers': 2})", "not valid JSON"},
      {R"({num_hidden_layers: 2})", "not valid JSON"},
      {R"({"num_hidden_layers": 2}})", "not valid JSON"},
      {R"({"num_hidden_layers": 2} {"head_dim": 64})", "not valid JSON"},
      {R"({"num_hidden_layers": 02})", "not valid JSON"},
      {R"({"num_hidden_layers": 2.})", "not valid JSON"},
      {R"({"num_hidden_layers": NaN})", "not valid JSON"},
      {R"({"num_hidden_layers": Infinity})", "not valid JSON"},
      {R"({"num_hidden_layers": 0x20})", "not valid JSON"},
      {R"({"num_hidden_layers": 1e999})", "not valid JSON"},
      {"// a comment\n{\"num_hidden_layers\": 2}", "not valid JSON"},
      {R"({"model_type": "unterminated})", "not valid JSON"},
      {R"({"model_type": "bad \q escape"})", "not valid JSON"},
      {R"({"model_type": "lone surrogate \ud800"})", "not valid JSON"},
      {"{\"model_type\": \"raw\nline break\"}", "not valid JSON"},
      {R"({"model_type": ")" + std::string(1 << 20, 'a'), "not valid JSON"},  // long token
      {"\xef\xbb\xbf", "not valid JSON"},                                     // a BOM only
  });
}

TEST(cli_hostile_config, NotAnObject) {
  expect_configs_rejected({
      {"42", "expected a JSON object, got number"},
      {"\"config\"", "expected a JSON object, got string"},
      {"null", "expected a JSON object, got null"},
      {"true", "expected a JSON object, got boolean"},
      {"[]", "expected a JSON object, got array"},
      {R"([{"num_hidden_layers": 2}])", "expected a JSON object, got array"},
  });
}

TEST(cli_hostile_config, DeepNestingIsRefusedWithoutRecursion) {
  constexpr std::size_t kDeep = 100000;
  std::string open_objects;
  for (std::size_t i = 0; i < kDeep; ++i)
    open_objects += "{\"a\":";
  const std::string deep_field =
      R"({"num_hidden_layers": )" + std::string(kDeep, '[') + std::string(kDeep, ']') + "}";
  std::string closed_objects = open_objects + "1";
  closed_objects += std::string(kDeep, '}');
  const auto start = std::chrono::steady_clock::now();
  expect_configs_rejected({
      {std::string(kDeep, '['), "JSON nested deeper than 64 levels"},
      {open_objects, "JSON nested deeper than 64 levels"},
      {deep_field, "JSON nested deeper than 64 levels"},  // dump() of it would recurse
      {closed_objects, "JSON nested deeper than 64 levels"},
      {R"({"text_config": )" + std::string(kDeep, '[') + std::string(kDeep, ']') + "}",
       "JSON nested deeper than 64 levels"},
  });
  EXPECT_LT(seconds_since(start), 5.0);

  // The limit itself: the root and 63 nested arrays are read, 64 are not.
  const std::string shape = R"("num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 64)";
  const auto nested = [&](std::size_t arrays) {
    return R"({"x": )" + std::string(arrays, '[') + std::string(arrays, ']') + ", " + shape + "}";
  };
  EXPECT_EQ(plan_with_config(nested(kMaxHfConfigDepth - 1)).code, 0);
  expect_rejected(plan_with_config(nested(kMaxHfConfigDepth)), "nested deeper than 64 levels");
}

TEST(cli_hostile_config, InvalidUtf8AndNulBytes) {
  using namespace std::string_literals;
  expect_configs_rejected({
      {"{\"model_type\": \"\xff\xfe\"}", "not valid JSON"},
      {"{\"\xc3\x28\": 1}", "not valid JSON"},                       // bad continuation in a key
      {"{\"model_type\": \"\xc0\xaf\"}", "not valid JSON"},          // overlong '/'
      {"{\"model_type\": \"\xed\xa0\x80\"}", "not valid JSON"},      // encoded surrogate
      {"{\"model_type\": \"\xf4\x90\x80\x80\"}", "not valid JSON"},  // above U+10FFFF
      {"{\"model_type\": \"\xe2\x82\"}", "not valid JSON"},          // cut short
      {"\xff{}", "not valid JSON"},
      {"\xff\xfe{\0\"\0}\0"s, "NUL byte at offset 3"},  // UTF-16
      {"\0"s, "NUL byte at offset 0"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"head_dim\": 64}\0garbage"s,
       "NUL byte at offset 66"},  // the JSON parser would stop at the NUL
      {"{\"num_hidden_layers\": 2\0}"s, "NUL byte"},
      {"{\"model_type\": \"a\0b\"}"s, "NUL byte"},
      {"{\"model_type\": \"\x1b[2J\x07\"}", "not valid JSON"},  // raw control characters
  });
}

TEST(cli_hostile_config, WrongTypesForEveryField) {
  const std::vector<std::string> values = {R"("32")",
                                           R"("")",
                                           "32.0",
                                           "32.5",
                                           "1e3",
                                           "true",
                                           "false",
                                           "[32]",
                                           R"({"value": 32})",
                                           "-1",
                                           "0",
                                           "-0",
                                           "1e308",
                                           "-1e308",
                                           "18446744073709551616",
                                           "-9223372036854775809",
                                           "[[[[[[[[[[32]]]]]]]]]]"};
  std::vector<std::pair<std::string, std::string>> cases;
  for (const char* field : {"num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                            "head_dim", "hidden_size"}) {
    for (const std::string& value : values) {
      cases.emplace_back(config_with(field, value),
                         std::string("'") + field + "' must be a positive integer");
    }
    // The same under a multimodal config's "text_config".
    for (const char* value : {R"("32")", "-1", "[32]"}) {
      cases.emplace_back(
          R"({"model_type": "llava", "text_config": )" + config_with(field, value) + "}",
          std::string("'") + field + "' must be a positive integer");
    }
  }
  expect_configs_rejected(cases);
}

TEST(cli_hostile_config, HugeAndInconsistentShapes) {
  expect_configs_rejected({
      {config_with("num_hidden_layers", "65537"), "more than the 65536 layers kvport supports"},
      {config_with("num_hidden_layers", "9223372036854775808"), "more than the 65536 layers"},
      {config_with("num_hidden_layers", "18446744073709551615"), "more than the 65536 layers"},
      {R"({"num_hidden_layers": 2, "num_key_value_heads": 4611686018427387904,
           "head_dim": 4611686018427387904})",
       "overflows"},
      {R"({"num_hidden_layers": 1, "num_key_value_heads": 18446744073709551615, "head_dim": 1})",
       "overflows"},
      {R"({"num_hidden_layers": 1, "num_attention_heads": 5, "hidden_size": 18446744073709551615})",
       "overflows"},
      {R"({"num_hidden_layers": 1, "num_attention_heads": 18446744073709551615,
           "hidden_size": 4096})",
       "hidden_size 4096 is not a multiple of num_attention_heads 18446744073709551615"},
      {R"({"num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 3})", "not a multiple"},
      {R"({"model_type": "llava", "text_config": 5})", "missing number of layers"},
      {"{}", "missing number of layers (--layers), KV heads (--kv-heads), head dim (--head-dim)"},
  });
}

TEST(cli_hostile_config, HugePerLayerListsAreRefusedWithoutTheirDom) {
  // A kept list longer than the layer limit is refused while it is parsed,
  // before its DOM exists: each list below has one entry too many and then a
  // syntax error, and the error reported is the limit, so the parser never
  // reached the rest of the text. (No wall-clock bound: sanitizer builds on a
  // shared 2-core machine make any such bound flaky.)
  const auto list = [](std::string_view item, std::size_t n) {
    std::string text;
    text.reserve(n * (item.size() + 1));
    for (std::size_t i = 0; i < n; ++i) {
      if (i > 0) text += ',';
      text += item;
    }
    return "[" + text + ", @ this is not JSON @";
  };
  const std::size_t n = kMaxModelLayers + 1;
  expect_configs_rejected({
      {R"({"model_type": "gpt_oss", "num_hidden_layers": 2, "layer_types": )" + list("\"\"", n),
       "a JSON array of more than 65536 elements ('layer_types')"},
      {R"({"model_type": "llama4", "text_config": {"num_hidden_layers": 2, "no_rope_layers": )" +
           list("0", n),
       "a JSON array of more than 65536 elements ('no_rope_layers')"},
      {R"({"num_hidden_layers": )" + list("[]", n),
       "a JSON array of more than 65536 elements ('num_hidden_layers')"},
  });
  // One entry fewer and the same tail is a syntax error: the tail is real.
  expect_configs_rejected({{R"({"model_type": "gpt_oss", "num_hidden_layers": 2, "layer_types": )" +
                                list("\"\"", kMaxModelLayers),
                            "syntax error"}});
  // At the limit a well-formed list is read (and its length checked).
  std::string at_limit = list("\"full_attention\"", kMaxModelLayers);
  at_limit.resize(at_limit.size() - std::string_view(", @ this is not JSON @").size());
  expect_configs_rejected(
      {{R"({"model_type": "gpt_oss", "num_hidden_layers": 2, "layer_types": )" + at_limit + "]}",
        "'layer_types' has 65536 entries but num_hidden_layers is 2"}});
}

TEST(cli_hostile_config, FilesThatAreNotSmallRegularFiles) {
  const TempFile dir_holder("placeholder", "");
  const std::filesystem::path dir = dir_holder.dir();
  const auto plan = [](const std::string& path) {
    return run_cli({"plan", "--hf-config", path, "--memory", "1GiB"});
  };

  expect_rejected(plan((dir / "missing.json").string()), "no such file");
  expect_rejected(plan(dir.string()), "is a directory");
  expect_rejected(plan(dir_holder.path() + "/config.json"), "not a directory");
  expect_rejected(plan(""), "--hf-config: empty path");
  expect_rejected(plan_with_config(""), "not valid JSON: the file is empty");
  expect_rejected(plan_with_config(" \n\t\r\n "), "not valid JSON: the file is empty");
  expect_rejected(plan("/dev/null"), "not valid JSON: the file is empty");

  std::filesystem::create_symlink(dir / "loop_b", dir / "loop_a");
  std::filesystem::create_symlink(dir / "loop_a", dir / "loop_b");
  expect_rejected(plan((dir / "loop_a").string()), "symbolic links");

  // A FIFO nobody writes to reads as empty instead of blocking the open.
  const std::filesystem::path fifo = dir / "fifo.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_rejected(plan(fifo.string()), "not valid JSON: the file is empty");

  if (::geteuid() != 0) {  // root reads it anyway
    const TempFile locked("config.json", kValidConfig);
    std::filesystem::permissions(locked.path(), std::filesystem::perms::none);
    expect_rejected(plan(locked.path()), "permission denied");
  }

  // An endless device is read up to the limit, not forever.
  const auto start = std::chrono::steady_clock::now();
  expect_rejected(plan("/dev/zero"), "larger than the limit of 16 MiB");
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(cli_hostile_config, OversizedFilesAreRefusedBeforeReading) {
  const TempFile holder("placeholder", "");
  const std::filesystem::path dir = holder.dir();

  // 100 MB of a giant JSON array.
  const std::filesystem::path giant = dir / "giant.json";
  {
    std::ofstream out(giant, std::ios::binary);
    const std::string chunk = [] {
      std::string s;
      while (s.size() < (1 << 20))
        s += "0,";
      return s;
    }();
    out << '[';
    for (int i = 0; i < 100; ++i)
      out << chunk;
    out << "0]";
  }
  ASSERT_GT(std::filesystem::file_size(giant), 100u << 20);
  auto start = std::chrono::steady_clock::now();
  expect_rejected(run_cli({"plan", "--hf-config", giant.string(), "--memory", "1GiB"}),
                  "is larger than the limit of 16 MiB (16777216 bytes) for a config file");
  EXPECT_LT(seconds_since(start), 2.0);

  // One byte over the limit is refused; at the limit a config is read.
  const std::string config(kValidConfig);
  std::string at_limit = config + std::string(kMaxHfConfigBytes - config.size(), ' ');
  {
    const TempFile over("config.json", at_limit + " ");
    start = std::chrono::steady_clock::now();
    expect_rejected(run_cli({"plan", "--hf-config", over.path(), "--memory", "1GiB"}),
                    "(16777217 bytes) is larger than the limit");
    EXPECT_LT(seconds_since(start), 2.0);
  }
  const TempFile exact("config.json", at_limit);
  EXPECT_EQ(run_cli({"plan", "--hf-config", exact.path(), "--memory", "1GiB"}).code, 0);
}

// --- Model presets and names -----------------------------------------------

TEST(cli_hostile_flags, UnknownPresetsAndNames) {
  std::vector<Case> cases;
  for (const std::string& name :
       {std::string(""), std::string(" "), std::string("gpt-5"), std::string("llama-3-8b "),
        std::string("llama-3-8b\n"), std::string("\xff\xfe"), std::string("a\x1b[2Jb\x07"),
        std::string("\xc2\x9b"
                    "31m"),
        std::string(100000, 'x')}) {
    // The list of known presets survives a huge name.
    cases.push_back({{"plan", "--model", name, "--memory", "1GiB"}, "(known: deepseek-v3"});
    // bench trims the name: "llama-3-8b " is a valid bench model.
    if (name.find("llama") == std::string::npos) {
      cases.push_back({{"bench", "--model", name}, "--model: "});
    }
  }
  for (const std::string& name : {std::string(""), std::string("tpu"), std::string("HOST"),
                                  std::string("host\n"), std::string("\xff")}) {
    cases.push_back({{"plan", "--model", "llama-3-8b", "--backend", name}, "unknown backend"});
    cases.push_back({{"demo", "--backend", name}, "unknown backend"});
    cases.push_back({{"bench", "--backend", name}, "unknown backend"});
  }
  for (const std::string& dtype :
       {std::string(""), std::string(" "), std::string("fp7"), std::string("BF16x"),
        std::string("bf 16"), std::string("f16,bf16"), std::string("int8"), std::string("\xff")}) {
    cases.push_back(
        {{"plan", "--model", "llama-3-8b", "--memory", "1GiB", "--dtype", dtype}, "--dtype"});
    cases.push_back({{"demo", "--dtype", dtype}, "--dtype: unknown dtype"});
  }
  for (const std::string& layout :
       {std::string(""), std::string("diagonal"), std::string("layer major"),
        std::string("layer__major"), std::string("\x1b")}) {
    cases.push_back(
        {{"plan", "--model", "llama-3-8b", "--memory", "1GiB", "--layout", layout}, "--layout"});
    cases.push_back({{"bench", "--layout", layout}, "--layout: "});
  }
  cases.push_back(
      {{"plan", "--model", "llama-3-8b", "--hf-config", "config.json"}, "--model and --hf-config"});
  expect_all_rejected(cases);
}

// --- Counts -----------------------------------------------------------------

TEST(cli_hostile_flags, BadCountsForEveryCountFlag) {
  std::vector<Case> cases;
  for (const std::string& value : bad_counts()) {
    for (const char* flag :
         {"--layers", "--kv-heads", "--head-dim", "--head-dim-k", "--head-dim-v", "--block-size"}) {
      cases.push_back({{"plan", "--model", "llama-3-8b", "--memory", "1GiB", flag, value}, flag});
    }
    cases.push_back({{"demo", "--requests", value}, "--requests"});
    cases.push_back({{"demo", "--max-running", value}, "--max-running"});
    if (value != "0") {  // 0 is a valid count of these
      cases.push_back({{"demo", "--shared-prompts", value}, "--shared-prompts"});
      cases.push_back({{"demo", "--seed", value}, "--seed"});
    }
    cases.push_back({{"bench", "--repetitions", value}, "--repetitions"});
    cases.push_back({{"bench", "--batches", value}, "--batches"});
  }
  expect_all_rejected(cases);
}

TEST(cli_hostile_flags, CountLimitsAndOverflows) {
  std::string many_batches;
  for (int i = 1; i <= 65; ++i)
    many_batches += (i > 1 ? "," : "") + std::to_string(i);
  expect_all_rejected({
      {{"plan", "--model", "llama-3-8b", "--memory", "1GiB", "--layers", "65537"},
       "--layers: 65537 layers is more than the 65536 kvport supports"},
      {{"plan", "--layers", "4294967296", "--kv-heads", "1", "--head-dim", "16", "--memory",
        "1TiB"},
       "--layers"},
      {{"plan", "--layers", "65536", "--kv-heads", "18446744073709551615", "--head-dim", "1",
        "--memory", "1GiB"},
       "overflows"},
      {{"plan", "--layers", "1", "--kv-heads", "4294967296", "--head-dim", "4294967296", "--memory",
        "1GiB"},
       "overflows"},
      {{"plan", "--model", "llama-3-8b", "--block-size", "18446744073709551615", "--memory",
        "1GiB"},
       "overflows"},
      {{"plan", "--model", "llama-3-8b", "--block-size", "4294967296", "--memory", "1GiB"},
       "smaller than one block"},
      {{"demo", "--requests", "100001"}, "--requests: at most 100000, got '100001'"},
      {{"demo", "--requests", "18446744073709551615"}, "--requests: at most 100000"},
      {{"bench", "--repetitions", "1001"}, "--repetitions: at most 1000"},
      {{"bench", "--batches", "1048577"}, "--batches: at most 1048576 blocks"},
      {{"bench", "--batches", many_batches}, "--batches: at most 64 sizes"},
      {{"bench", "--batches", ","}, "--batches"},
      {{"bench", "--batches", "1,"}, "--batches"},
      {{"bench", "--batches", ",1"}, "--batches"},
      {{"bench", "--batches", "1,,2"}, "--batches"},
      {{"bench", "--batches", "1;2"}, "--batches"},
  });
}

// --- Layer dtype lists ------------------------------------------------------

TEST(cli_hostile_flags, LayerDtypeLists) {
  std::string thirty_three, one_empty;
  for (int i = 0; i < 33; ++i)
    thirty_three += (i > 0 ? "," : "") + std::string("bf16");
  for (int i = 0; i < 32; ++i)
    one_empty += (i > 0 ? "," : "") + std::string(i == 7 ? "" : "bf16");
  std::vector<Case> cases;
  for (const std::string& spec : {std::string(""),
                                  std::string(" "),
                                  std::string(","),
                                  std::string(":"),
                                  std::string("0:"),
                                  std::string(":bf16"),
                                  std::string("0:bf16:f16"),
                                  std::string("-1:bf16"),
                                  std::string("0-:bf16"),
                                  std::string("-0:bf16"),
                                  std::string("0--1:bf16"),
                                  std::string("32:bf16"),
                                  std::string("18446744073709551616:bf16"),
                                  std::string("0-99999999999999999999:bf16"),
                                  std::string("last-first:bf16"),
                                  std::string("x:bf16"),
                                  std::string("0:fp7"),
                                  std::string("bf16,bf16"),
                                  thirty_three,
                                  one_empty,
                                  std::string("0:bf16,f16"),
                                  std::string("first:bf16,,last:bf16"),
                                  std::string("0 - 3 : bf16x"),
                                  std::string("\xff:bf16")}) {
    cases.push_back({{"plan", "--model", "llama-3-8b", "--memory", "1GiB", "--layer-dtypes", spec},
                     "--layer-dtypes"});
  }
  // Groups that do not divide the head dim.
  cases.push_back({{"plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--dtype",
                    "nvfp4", "--memory", "1GiB"},
                   "head_dim"});
  cases.push_back({{"plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--dtype",
                    "turbo3", "--memory", "1GiB"},
                   "head_dim"});
  cases.push_back({{"plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--layer-dtypes",
                    "last:nvfp4", "--memory", "1GiB"},
                   "head_dim"});
  expect_all_rejected(cases);
}

// --- Byte sizes and fractions -----------------------------------------------

TEST(cli_hostile_flags, ByteSizes) {
  std::vector<Case> cases;
  for (const std::string& size : {std::string(""),
                                  std::string(" "),
                                  std::string("-1"),
                                  std::string("-5GiB"),
                                  std::string("- 5GiB"),
                                  std::string("0"),
                                  std::string("0GiB"),
                                  std::string("0.0000001KiB"),
                                  std::string("0.5B"),
                                  std::string("1.5"),
                                  std::string("1e308"),
                                  std::string("1E3"),
                                  std::string("18446744073709551616"),
                                  std::string("17179869184GiB"),
                                  std::string("99999999999TiB"),
                                  std::string("16EiB"),
                                  std::string("1PB"),
                                  std::string("nan"),
                                  std::string("inf"),
                                  std::string("-inf"),
                                  std::string("0x10"),
                                  std::string("1..5GiB"),
                                  std::string("."),
                                  std::string("GiB"),
                                  std::string("1 GiB extra"),
                                  std::string("1GiB1"),
                                  std::string("+1GiB"),
                                  std::string("1,5GiB"),
                                  std::string("\xef\xbc\x91GiB"),  // FULLWIDTH DIGIT ONE
                                  std::string("\xff"),
                                  std::string(10000, '9')}) {
    cases.push_back({{"plan", "--model", "llama-3-8b", "--memory", size}, "--memory"});
    cases.push_back({{"demo", "--memory", size}, "--memory"});
  }
  cases.push_back(
      {{"plan", "--model", "llama-3-8b", "--memory", "1MiB"}, "smaller than one block"});
  expect_all_rejected(cases);

  // The host backend's size comes from the environment.
  for (const char* value : {"garbage", "-1", "18446744073709551616", "1.5"}) {
    SCOPED_TRACE(value);
    const ScopedEnv env("KVPORT_HOST_MEMORY", value);
    expect_rejected(
        run_cli({"plan", "--model", "llama-3-8b", "--memory", "device", "--backend", "host"}),
        "KVPORT_HOST_MEMORY: invalid byte size");
  }
  const ScopedEnv no_memory("KVPORT_HOST_MEMORY", "0");
  expect_rejected(
      run_cli({"plan", "--model", "llama-3-8b", "--memory", "device", "--backend", "host"}),
      "reports no free memory");
}

TEST(cli_hostile_flags, Fractions) {
  const ScopedEnv memory("KVPORT_HOST_MEMORY", "64GiB");
  std::vector<Case> cases;
  for (const std::string& value :
       {std::string(""),          std::string(" "),     std::string("0"),
        std::string("-0"),        std::string("-0.5"),  std::string("1.5"),
        std::string("1.0000001"), std::string("nan"),   std::string("NaN"),
        std::string("-nan"),      std::string("inf"),   std::string("-inf"),
        std::string("infinity"),  std::string("1e309"), std::string("1e-400"),
        std::string("abc"),       std::string("0.9x"),  std::string("0,9"),
        std::string("90%"),       std::string("\xff")}) {
    cases.push_back({{"plan", "--model", "llama-3-8b", "--backend", "host", "--utilization", value},
                     "--utilization: expected a fraction in (0, 1]"});
  }
  // Tiny but positive: a budget of 0 bytes, said as such.
  cases.push_back(
      {{"plan", "--model", "llama-3-8b", "--backend", "host", "--utilization", "1e-300"},
       "--utilization 1e-300 of 64.00 GiB free on host is a budget of 0 bytes"});
  cases.push_back({{"plan", "--model", "llama-3-8b", "--memory", "1GiB", "--utilization", "0.5"},
                   "--utilization applies to --memory device only"});
  expect_all_rejected(cases);
}

// --- Out of memory ----------------------------------------------------------

TEST(cli_hostile_flags, RequestsLargerThanTheBackend) {
  const ScopedEnv memory("KVPORT_HOST_MEMORY", "64MiB");
  expect_all_rejected({
      {{"demo", "--backend", "host", "--memory", "128MiB"}, "host: out of memory"},
      // Checked before the bench prints its header.
      {{"bench", "--backend", "host", "--model", "llama-3-8b", "--batches", "32"},
       "--batches: 32 blocks of llama-3-8b need 192.00 MiB"},
      {{"bench", "--backend", "host", "--model", "llama-3-70b", "--batches", "1048576"},
       "more than the 64.00 MiB free on the host backend"},
  });
}

// --- Empty selections, conformance, the command line ------------------------

TEST(cli_hostile_flags, EmptyValuesAreNotDefaults) {
  expect_all_rejected({
      {{"bench", "--model", ""}, "--model: empty value"},
      {{"bench", "--layout", " "}, "--layout: empty value"},
      {{"bench", "--batches", ""}, "--batches: empty value"},
      {{"bench", "--repetitions", ""}, "--repetitions: empty value"},
      {{"conformance", "--backend", ""}, "--backend: empty value"},
      {{"conformance", "--filter", ""}, "--filter: empty value"},
      {{"conformance", "--suite", ""}, "--suite: empty value"},
  });
}

TEST(cli_hostile_flags, Conformance) {
  const TempFile not_executable("suite", "#!/bin/sh\nexit 0\n");
  const std::string suite = KVPORT_CONFORMANCE_BINARY;
  std::vector<Case> cases;
  for (const char* filter : {"a:b", "Zero-Blocks", "x/y", "a.b", " ", "\xff"}) {
    cases.push_back(
        {{"conformance", "--suite", suite, "--filter", filter}, "is not a test name pattern"});
  }
  for (const char* backend : {"host:gpusim", "host-x", "*", "\x1b"}) {
    cases.push_back(
        {{"conformance", "--suite", suite, "--backend", backend}, "is not a backend name"});
  }
  cases.push_back(
      {{"conformance", "--suite", suite, "--backend", "tpu"}, "--backend: unknown backend 'tpu'"});
  cases.push_back({{"conformance", "--suite", suite, "--backend", "host", "--filter", "NoSuchTest"},
                   "no test matches"});
  cases.push_back({{"conformance", "--suite", "/nonexistent/kvport_conformance"}, "not found"});
  cases.push_back({{"conformance", "--suite", not_executable.dir()}, "it is a directory"});
  cases.push_back({{"conformance", "--suite", not_executable.path()}, "not an executable file"});
  expect_all_rejected(cases);

  const ScopedEnv env("KVPORT_CONFORMANCE", "/nonexistent/kvport_conformance");
  expect_rejected(run_cli({"conformance"}), "'/nonexistent/kvport_conformance' not found");
}

TEST(cli_hostile_flags, EnvironmentAndLogLevel) {
  std::vector<Case> cases;
  for (const std::string& level : {std::string(""), std::string("loud"), std::string("\xff")}) {
    cases.push_back({{"--log-level", level, "plan", "--model", "llama-3-8b", "--memory", "1GiB"},
                     "--log-level: unknown log level"});
  }
  expect_all_rejected(cases);
  {
    const ScopedEnv env("KVPORT_LOG_LEVEL", "loud");
    expect_rejected(run_cli({"plan", "--model", "llama-3-8b", "--memory", "1GiB"}),
                    "KVPORT_LOG_LEVEL: unknown log level 'loud'");
  }
  const ScopedEnv env("KVPORT_BACKEND", "tpu");
  expect_rejected(run_cli({"demo"}), "KVPORT_BACKEND: unknown backend 'tpu'");
}

TEST(cli_hostile_flags, CommandLineShape) {
  const std::string huge(1 << 20, 'x');
  expect_all_rejected({
      {{"frobnicate"}, "frobnicate"},
      {{"plan", "plan"}, "plan"},
      {{"plan", "--model"}, "--model"},
      {{"plan", "--memory="}, "--memory"},
      {{"plan", "--json=banana", "--model", "llama-3-8b"}, "banana"},
      {{"plan", "-x"}, "-x"},
      {{"plan", "--model", "llama-3-8b", huge}, "xxxxxxxx"},
      {{"plan", "--" + huge}, "--xxxxxxxx"},
      {{"demo", "--requests", "1", "--requests"}, "--requests"},
  });
}

}  // namespace
}  // namespace kvport::cli::testing
