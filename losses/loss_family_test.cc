#include "losses/loss_family.h"

#include <set>

#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "proto/loss.pb.h"

namespace dflash {
namespace {

// Every family the schema declares (LossConfig's `family` oneof, read from
// the descriptor, not listed here) resolves to a LossFamily of its own whose
// traits carry the field's name: a family added to loss.proto but not to
// the table in loss_family.cc fails here.
TEST(LossFamilyTest, TableCoversEveryFamilyOfTheSchema) {
  const google::protobuf::OneofDescriptor* oneof =
      v1::LossConfig::descriptor()->FindOneofByName("family");
  ASSERT_NE(oneof, nullptr);
  ASSERT_GT(oneof->field_count(), 0);
  std::set<LossFamily> families;
  for (int i = 0; i < oneof->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = oneof->field(i);
    SCOPED_TRACE(field->name());
    v1::LossConfig config;
    config.GetReflection()->MutableMessage(&config, field);
    const LossParams params = LossParamsOf(config);
    EXPECT_NE(params.family, LossFamily::kNone);
    EXPECT_TRUE(families.insert(params.family).second)
        << "shares its LossFamily with another field";
    EXPECT_EQ(LossTraitsOf(params).name, field->name());
    EXPECT_EQ(LossTraitsOf(config).name, field->name());
  }
  EXPECT_EQ(LossParamsOf(v1::LossConfig()).family, LossFamily::kNone);
}

}  // namespace
}  // namespace dflash
